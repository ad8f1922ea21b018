-- Fenced dead-lettering: copy the entry to the DLQ with its reason and XACK it; when the
-- request id is known, also end its output with an error chunk (out:{id} and the feeds
-- following it, after the tail not yet flushed) so no reader is left waiting, and drop its
-- progress.
-- KEYS: 1 work stream, 2 dlq, 3 req:{id} (or the dlq key when unknown), 4 out:{id} (likewise),
--       5 prog hash
-- ARGV: 1 group, 2 consumer, 3 entry id, 4 payload, 5 reason, 6 request id ("" = unknown),
--       7 error chunk payload ("" = none), 8 chunk index, 9 out ttl s, 10 now, 11 dlq maxlen,
--       12 feed channel prefix
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
  local p = prog_parse(redis.call('HGET', KEYS[5], ARGV[6]))
  local emitted = tonumber(redis.call('HGET', KEYS[3], ${EMITTED}) or '0')
  local history = ''
  if p then
    local chunks
    chunks, emitted = tail_chunks(KEYS[5], ARGV[6], p)
    for _, chunk in ipairs(chunks) do history = history .. frame(chunk) end
  end
  if ARGV[7] ~= '' and emitted == tonumber(ARGV[8]) then
    history = history .. frame(ARGV[7])
    if p then
      for feed in string.gmatch(p.feeds, '[^,]+') do
        redis.call('SPUBLISH', ARGV[12] .. feed, frame(ARGV[6]) .. frame(ARGV[7]))
      end
    end
  end
  if history ~= '' then
    redis.call('XADD', KEYS[4], '*', ${MESSAGE_FIELD}, history)
    redis.call('EXPIRE', KEYS[4], tonumber(ARGV[9]))
  end
  if p then redis.call('HDEL', KEYS[5], ARGV[6]) end
  redis.call('HSET', KEYS[3], ${STATUS}, ${STATUS.FAILED}, ${FINISH_REASON},
    ${FINISH_REASON.ERROR}, ${ERROR}, ARGV[5], ${UPDATED}, ARGV[10], ${EMITTED}, emitted,
    ${COMPLETION_TOKENS}, emitted)
end
return dlq_id
