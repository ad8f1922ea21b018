-- Fenced hand-off: if this consumer still owns the entry, optionally emit one chunk (the
-- prefill worker's first token), XADD the task to the next stream and XACK the current entry.
-- KEYS: 1 current stream, 2 next stream, 3 req:{id}, 4 out:{id}
-- ARGV: 1 group, 2 consumer, 3 entry id, 4 next payload, 5 chunk payload ("" = none),
--       6 chunk index, 7 chunk token count, 8.. req fields
-- Returns {1, new entry id}, {0, 'not-owner'} or {-1, emitted} on an index mismatch.
if not owns(KEYS[1], ARGV[1], ARGV[3], ARGV[2]) then
  return {0, 'not-owner'}
end
if ARGV[5] ~= '' then
  local emitted = tonumber(redis.call('HGET', KEYS[3], ${EMITTED}) or '0')
  if emitted ~= tonumber(ARGV[6]) then
    return {-1, emitted}
  end
  redis.call('XADD', KEYS[4], '*', ${MESSAGE_FIELD}, ARGV[5])
  emitted = emitted + tonumber(ARGV[7])
  redis.call('HSET', KEYS[3], ${EMITTED}, emitted, ${COMPLETION_TOKENS}, emitted)
end
local new_id = redis.call('XADD', KEYS[2], '*', ${MESSAGE_FIELD}, ARGV[4])
redis.call('XACK', KEYS[1], ARGV[1], ARGV[3])
hset_pairs(KEYS[3], ARGV, 8)
return {1, new_id}
