-- Poison or churn? Count the holders of an entry that died *running* it since it last made
-- progress (tokens emitted between two claims). A claim after progress starts the count again,
-- so a request whose holders keep being killed while it advances is never taken for poison.
-- A holder that died before it began running the entry (it waited in that holder's queue, or
-- behind a suspect running alone) is no strike: the entry cannot have caused that death. The
-- first holder is taken to have run it (nothing is recorded on that hot path); a later one
-- runs an entry with strikes alone and says so first (`ran.lua`: claim_ran = its delivery).
-- KEYS: 1 req:{id}, 2 prog hash
-- ARGV: 1 entry id, 2 deliveries so far (this one included), 3 tokens the task carried when
--       first queued (the emitted count at its first delivery), 4 "1" when the claimant is
--       the live holder itself (no crash, so the count restarts too), 5 request id
-- Returns the strikes: holders that died running it since its last progress (0 = progress).
local deliveries = tonumber(ARGV[2])
if redis.call('EXISTS', KEYS[1]) == 0 then
  return deliveries - 1  -- no record to keep the count in: every redelivery is a strike
end
local p = prog_parse(redis.call('HGET', KEYS[2], ARGV[5]))
local emitted = tonumber(redis.call('HGET', KEYS[1], ${EMITTED}) or '0')
if p then
  emitted = tail_end(KEYS[2], ARGV[5], p)
end
local seen = redis.call('HMGET', KEYS[1], ${CLAIM_ENTRY}, ${CLAIM_EMITTED}, ${CLAIM_DELIVERY},
  ${CLAIM_STRIKES}, ${CLAIM_SEEN}, ${CLAIM_RAN})
local base_emitted, base_delivery, strikes, last, ran = tonumber(ARGV[3]), 1, 0, 1, nil
if seen[1] == ARGV[1] then
  base_emitted, base_delivery = tonumber(seen[2]), tonumber(seen[3])
  strikes, last = tonumber(seen[4] or '0') or 0, tonumber(seen[5] or '1') or 1
  ran = tonumber(seen[6] or '')
end
if emitted > base_emitted or ARGV[4] == '1' then
  base_emitted, base_delivery, strikes = emitted, deliveries, 0
elseif last == 1 or (ran and ran >= last and ran < deliveries) then
  -- the holders of deliveries last .. deliveries-1 are gone, and one of them was running it
  strikes = strikes + 1
end
redis.call('HSET', KEYS[1], ${CLAIM_ENTRY}, ARGV[1], ${CLAIM_EMITTED}, base_emitted,
  ${CLAIM_DELIVERY}, base_delivery, ${CLAIM_STRIKES}, strikes, ${CLAIM_SEEN}, deliveries)
return strikes
