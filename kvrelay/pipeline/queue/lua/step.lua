-- One worker step: every sequence's chunk in one call (docs/internals.md "Queue plane").
-- Per sequence: only the owner (`consumer/entry id` in its progress) may write, and the chunk
-- must start at the tokens already emitted; the chunk joins the progress tail (and out:{id}
-- on a flush or the end) and the step's entry of each feed following the request. A hand-off
-- also queues the next stage's task and acks the entry; an end acks it, writes the record's
-- final fields and drops the progress. Returns {results, cancelled}: per sequence {1, emitted},
-- {0, 'not-owner'} or {-1, emitted} (index mismatch); then the ids among the sequences and the
-- `check` ids whose cancel flag is set.
-- KEYS: 1 work stream, 2 next stream (hand-offs), 3 prog hash, then per sequence req:{id}, out:{id}
-- ARGV: 1 group, 2 consumer, 3 feed key prefix, 4 ttl_fields, 5 out ttl s, 6 req ttl s,
--       7 feed maxlen, 8 sequences N, 9 check ids M, then per sequence: entry id, request id,
--       chunk index, chunk token count, chunk payload, mode ('e' emit, 'f' emit and flush the
--       tail to out:{id}, 'd' done, 'h' hand-off), next task payload ('' unless 'h'), number F
--       of record field/value items, the F items; then the M check ids.
local group, consumer, feed_prefix, ttl_fields = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local out_ttl, req_ttl, maxlen = tonumber(ARGV[5]), tonumber(ARGV[6]), ARGV[7]
local n, m = tonumber(ARGV[8]), tonumber(ARGV[9])
local seqs, ids = {}, {}
local at = 10
for i = 1, n do
  local s = {entry = ARGV[at], rid = ARGV[at + 1], index = tonumber(ARGV[at + 2]),
             ntok = tonumber(ARGV[at + 3]), chunk = ARGV[at + 4], mode = ARGV[at + 5],
             next = ARGV[at + 6], nf = tonumber(ARGV[at + 7]), first = at + 8}
  at = at + 8 + s.nf
  seqs[i] = s
  ids[i] = s.rid
end
for j = 1, m do ids[n + j] = ARGV[at + j - 1] end
if #ids == 0 then return {{}, {}} end
local values = redis.call('HMGET', KEYS[3], unpack(ids))
local results, cancelled, stores, acks, drops, feeds, feed_order = {}, {}, {}, {}, {}, {}, {}
for i = 1, n do
  local s = seqs[i]
  local p = prog_parse(values[i])
  if not p or p.owner ~= consumer .. '/' .. s.entry then
    results[i] = {0, 'not-owner'}
  elseif p.emitted ~= s.index then
    results[i] = {-1, p.emitted}
  else
    local req, out = KEYS[2 + 2 * i], KEYS[3 + 2 * i]
    p.emitted = p.emitted + s.ntok
    p.tail = p.tail .. frame(s.chunk)
    for feed in string.gmatch(p.feeds, '[^,]+') do
      local items = feeds[feed]
      if not items then
        items = {}
        feeds[feed] = items
        feed_order[#feed_order + 1] = feed
      end
      items[#items + 1] = s.rid
      items[#items + 1] = s.chunk
    end
    local fields = {}
    if s.mode == 'f' or s.mode == 'd' then
      redis.call('XADD', out, '*', ${MESSAGE_FIELD}, p.tail)
      p.hist, p.tail = p.emitted, ''
      fields = {${EMITTED}, p.emitted, ${COMPLETION_TOKENS}, p.emitted}
    end
    for k = s.first, s.first + s.nf - 1 do fields[#fields + 1] = ARGV[k] end
    if #fields > 0 then redis.call('HSET', req, unpack(fields)) end
    if s.mode == 'd' then
      redis.call('EXPIRE', out, out_ttl)
      redis.call('EXPIRE', req, req_ttl)
      acks[#acks + 1] = s.entry
      drops[#drops + 1] = s.rid
    else
      if s.mode == 'h' then
        redis.call('XADD', KEYS[2], '*', ${MESSAGE_FIELD}, s.next)
        acks[#acks + 1] = s.entry
        p.owner = ''
      end
      stores[#stores + 1] = s.rid
      stores[#stores + 1] = prog_encode(p)
    end
    results[i] = {1, p.emitted}
  end
  if p and p.cancel == '1' then cancelled[#cancelled + 1] = s.rid end
end
for j = 1, m do
  local p = prog_parse(values[n + j])
  if p and p.cancel == '1' then cancelled[#cancelled + 1] = ids[n + j] end
end
prog_store(KEYS[3], stores, ttl_fields)
if #drops > 0 then redis.call('HDEL', KEYS[3], unpack(drops)) end
if #acks > 0 then redis.call('XACK', KEYS[1], group, unpack(acks)) end
for _, feed in ipairs(feed_order) do
  redis.call('XADD', feed_prefix .. feed, 'NOMKSTREAM', 'MAXLEN', '~', maxlen, '*',
    unpack(feeds[feed]))
end
return {results, cancelled}
