-- Fenced token emission: append one TokenChunk to out:{id} only if this consumer still owns
-- the stream entry and the chunk starts exactly at the number of tokens already emitted.
-- KEYS: 1 work stream, 2 out:{id}, 3 req:{id}
-- ARGV: 1 group, 2 consumer, 3 entry id, 4 chunk index, 5 chunk token count, 6 chunk payload,
--       7 final ("1" acks the entry and starts expiry), 8 out ttl s, 9 req ttl s, 10.. req fields
-- Returns {1, emitted} on success, {0, 'not-owner'} or {-1, emitted} on an index mismatch.
if not owns(KEYS[1], ARGV[1], ARGV[3], ARGV[2]) then
  return {0, 'not-owner'}
end
local emitted = tonumber(redis.call('HGET', KEYS[3], ${EMITTED}) or '0')
if emitted ~= tonumber(ARGV[4]) then
  return {-1, emitted}
end
redis.call('XADD', KEYS[2], '*', ${MESSAGE_FIELD}, ARGV[6])
emitted = emitted + tonumber(ARGV[5])
redis.call('HSET', KEYS[3], ${EMITTED}, emitted, ${COMPLETION_TOKENS}, emitted)
hset_pairs(KEYS[3], ARGV, 10)
if ARGV[7] == '1' then
  redis.call('XACK', KEYS[1], ARGV[1], ARGV[3])
  redis.call('EXPIRE', KEYS[2], tonumber(ARGV[8]))
  redis.call('EXPIRE', KEYS[3], tonumber(ARGV[9]))
end
return {1, emitted}
