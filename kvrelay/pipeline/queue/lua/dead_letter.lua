-- Fenced dead-lettering: copy the entry to the DLQ with its reason and XACK it; when the
-- request id is known, also finish out:{id} with an error chunk so the client is not left waiting.
-- KEYS: 1 work stream, 2 dlq, 3 req:{id} (or the dlq key when unknown), 4 out:{id} (likewise)
-- ARGV: 1 group, 2 consumer, 3 entry id, 4 payload, 5 reason, 6 request id ("" = unknown),
--       7 error chunk payload ("" = none), 8 chunk index, 9 out ttl s, 10 now, 11 dlq maxlen
-- Returns the DLQ entry id, or 0 when the consumer no longer owns the entry.
if not owns(KEYS[1], ARGV[1], ARGV[3], ARGV[2]) then
  return 0
end
local dlq_id = redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[11], '*',
  ${MESSAGE_FIELD}, ARGV[4], ${DLQ.REASON}, ARGV[5], ${DLQ.STREAM}, KEYS[1],
  ${DLQ.ENTRY_ID}, ARGV[3], ${DLQ.CONSUMER}, ARGV[2], ${DLQ.REQUEST_ID}, ARGV[6],
  ${DLQ.TIME}, ARGV[10])
redis.call('XACK', KEYS[1], ARGV[1], ARGV[3])
if ARGV[6] ~= '' then
  local emitted = tonumber(redis.call('HGET', KEYS[3], ${EMITTED}) or '0')
  if ARGV[7] ~= '' and emitted == tonumber(ARGV[8]) then
    redis.call('XADD', KEYS[4], '*', ${MESSAGE_FIELD}, ARGV[7])
    redis.call('EXPIRE', KEYS[4], tonumber(ARGV[9]))
  end
  redis.call('HSET', KEYS[3], ${STATUS}, ${STATUS.FAILED}, ${FINISH_REASON},
    ${FINISH_REASON.ERROR}, ${ERROR}, ARGV[5], ${UPDATED}, ARGV[10])
end
return dlq_id
