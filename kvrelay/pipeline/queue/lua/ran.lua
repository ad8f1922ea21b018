-- A holder is about to run a suspect entry (one with strikes) alone: record its delivery, so
-- that if this holder dies, the next claim counts the death as a strike (strikes.lua).
-- KEYS: 1 req:{id}
-- ARGV: 1 entry id, 2 the holder's delivery of it
-- Returns 1 when recorded; 0 when the record is gone or counts another entry now.
if redis.call('HGET', KEYS[1], ${CLAIM_ENTRY}) ~= ARGV[1] then
  return 0
end
redis.call('HSET', KEYS[1], ${CLAIM_RAN}, ARGV[2])
return 1
