-- One worker step: every sequence's chunk in one call (docs/internals.md "Queue plane").
-- Per sequence: only the owner (`consumer/entry id` in its progress) may write, and the chunk
-- must start at the tokens already emitted. The chunk goes to the step's entry of each feed
-- following the request and to its tail (a `<id>#<index>` field of the prog hash), or, on a flush, a hand-off or the
-- end, `out:{id}` gets the tail and the chunk (framed, given by the worker, which keeps its
-- tail) and the tail's fields go. A hand-off also queues the next stage's task and acks the
-- entry; an end acks it, writes the record's final fields and drops the progress.
-- Returns {results, cancelled}: per sequence two items, 1 and the tokens emitted, 0 and
-- 'not-owner' or -1 and the tokens emitted (index mismatch); then the ids among the
-- sequences and the `check` ids whose cancel flag is set.
-- KEYS: 1 work stream, 2 next stream (hand-offs), 3 prog hash (progress and tails), then per
--       sequence req:{id}, out:{id}
-- ARGV: 1 group, 2 feed key prefix, 3 ttl_fields, 4 out ttl s, 5 req ttl s, 6 feed maxlen,
--       7 sequences N, 8 check ids M, then per sequence: owner, request id, chunk index,
--       chunk token count, chunk payload, mode ('e' emit, 'f' flush, 'd' done, 'h' hand-off),
--       out:{id} payload (the framed tail and chunk; '' for 'e'), number D of tail fields to
--       drop, the D fields, next task payload ('' unless 'h'), number F of record field/value
--       items, the F items; then the M check ids.
local group, feed_prefix, ttl_fields = ARGV[1], ARGV[2], ARGV[3]
local out_ttl, req_ttl, maxlen = tonumber(ARGV[4]), tonumber(ARGV[5]), ARGV[6]
local n, m = tonumber(ARGV[7]), tonumber(ARGV[8])
local starts, ids = {}, {}
local at = 9
for i = 1, n do
  starts[i] = at
  ids[i] = ARGV[at + 1]
  local nd = tonumber(ARGV[at + 7])
  at = at + 8 + nd + 1
  at = at + 1 + tonumber(ARGV[at])
end
for j = 1, m do ids[n + j] = ARGV[at + j - 1] end
if #ids == 0 then return {{}, {}} end
local values = redis.call('HMGET', KEYS[3], unpack(ids))
local results, cancelled, stores, acks, ends, drops = {}, {}, {}, {}, {}, {}
local feeds, feed_order = {}, {}
local function to_feed(feed, rid, chunk)
  local items = feeds[feed]
  if not items then
    items = {}
    feeds[feed] = items
    feed_order[#feed_order + 1] = feed
  end
  items[#items + 1] = rid
  items[#items + 1] = chunk
end
-- the hot path (mode 'e', no record fields) allocates no table per sequence: the progress is
-- matched into locals (PROG_LINES, not prog_parse) and joined back
for i = 1, n do
  local a = starts[i]
  local rid, mode, chunk, index = ARGV[a + 1], ARGV[a + 5], ARGV[a + 4], ARGV[a + 2]
  local e, h, c, f, o
  if values[i] then
    e, h, c, f, o = string.match(values[i], PROG_LINES)
  end
  if not e or o ~= ARGV[a] then
    results[2 * i - 1], results[2 * i] = 0, 'not-owner'
  elseif e ~= index then
    results[2 * i - 1], results[2 * i] = -1, tonumber(e)
  else
    local emitted = tonumber(e) + tonumber(ARGV[a + 3])
    if f ~= '' then
      if not string.find(f, ',', 1, true) then
        to_feed(f, rid, chunk)
      else
        for feed in string.gmatch(f, '[^,]+') do to_feed(feed, rid, chunk) end
      end
    end
    local nd = tonumber(ARGV[a + 7])
    local nf_at = a + 8 + nd + 1
    local nf = tonumber(ARGV[nf_at])
    local fields
    if mode == 'e' then
      stores[#stores + 1] = rid .. '#' .. index
      stores[#stores + 1] = chunk
    else
      redis.call('XADD', KEYS[3 + 2 * i], '*', ${MESSAGE_FIELD}, ARGV[a + 6])
      for k = a + 8, a + 7 + nd do drops[#drops + 1] = ARGV[k] end
      h = emitted
      fields = {${EMITTED}, emitted, ${COMPLETION_TOKENS}, emitted}
    end
    if nf > 0 then
      fields = fields or {}
      for k = nf_at + 1, nf_at + nf do fields[#fields + 1] = ARGV[k] end
    end
    local req = KEYS[2 + 2 * i]
    if fields then redis.call('HSET', req, unpack(fields)) end
    if mode == 'd' then
      redis.call('EXPIRE', KEYS[3 + 2 * i], out_ttl)
      redis.call('EXPIRE', req, req_ttl)
      acks[#acks + 1] = string.match(o, '.*/(.*)$')
      ends[#ends + 1] = rid
    else
      if mode == 'h' then
        redis.call('XADD', KEYS[2], '*', ${MESSAGE_FIELD}, ARGV[a + 8 + nd])
        acks[#acks + 1] = string.match(o, '.*/(.*)$')
        o = ''
      end
      stores[#stores + 1] = rid
      stores[#stores + 1] = prog_join(emitted, h, c, f, o)
    end
    results[2 * i - 1], results[2 * i] = 1, emitted
  end
  if c == '1' then cancelled[#cancelled + 1] = rid end
end
for j = 1, m do
  local p = prog_parse(values[n + j])
  if p and p.cancel == '1' then cancelled[#cancelled + 1] = ids[n + j] end
end
-- one write for every progress and tail field of the step (each lives req ttl past it)
if #stores > 0 then
  if ttl_fields == '1' then
    redis.call('HSETEX', KEYS[3], 'EX', req_ttl, 'FIELDS', #stores / 2, unpack(stores))
  else
    redis.call('HSET', KEYS[3], unpack(stores))
  end
end
for _, rid in ipairs(ends) do drops[#drops + 1] = rid end
if #drops > 0 then redis.call('HDEL', KEYS[3], unpack(drops)) end
if #acks > 0 then redis.call('XACK', KEYS[1], group, unpack(acks)) end
for _, feed in ipairs(feed_order) do
  redis.call('XADD', feed_prefix .. feed, 'NOMKSTREAM', 'MAXLEN', '~', maxlen, '*',
    unpack(feeds[feed]))
end
return {results, cancelled}
