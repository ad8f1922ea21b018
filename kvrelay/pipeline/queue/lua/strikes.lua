-- Poison or churn? Count the deliveries of an entry since it last made progress (tokens
-- emitted between two claims). A claim after progress starts the count again, so a request
-- whose holders keep being killed while it advances is never taken for poison.
-- KEYS: 1 req:{id}, 2 prog hash
-- ARGV: 1 entry id, 2 deliveries so far (this one included), 3 tokens the task carried when
--       first queued (the emitted count at its first delivery), 4 "1" when the claimant is
--       the live holder itself (no crash, so the count restarts too), 5 request id
-- Returns the strikes: deliveries since the last one that found new tokens (0 = progress).
local deliveries = tonumber(ARGV[2])
if redis.call('EXISTS', KEYS[1]) == 0 then
  return deliveries - 1  -- no record to keep the baseline in (expired or never written)
end
local p = prog_parse(redis.call('HGET', KEYS[2], ARGV[5]))
local emitted = tonumber(redis.call('HGET', KEYS[1], ${EMITTED}) or '0')
if p then
  emitted = tail_end(KEYS[2], ARGV[5], p)
end
local seen = redis.call('HMGET', KEYS[1], ${CLAIM_ENTRY}, ${CLAIM_EMITTED}, ${CLAIM_DELIVERY})
local base_emitted, base_delivery = tonumber(ARGV[3]), 1
if seen[1] == ARGV[1] then
  base_emitted, base_delivery = tonumber(seen[2]), tonumber(seen[3])
end
if emitted > base_emitted or ARGV[4] == '1' then
  base_emitted, base_delivery = emitted, deliveries
end
redis.call('HSET', KEYS[1], ${CLAIM_ENTRY}, ARGV[1], ${CLAIM_EMITTED}, base_emitted,
  ${CLAIM_DELIVERY}, base_delivery)
return deliveries - base_delivery
