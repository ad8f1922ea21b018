-- One worker step: every sequence's chunk in one call (docs/internals.md "Queue plane").
-- The fence is per worker, not per sequence: the caller's consumer must not be fenced (a claim
-- of its entries sets its fence key to 'f') and the step number must be new (a retried step
-- whose reply was lost is recognised: nothing is written again). One SET ... GET checks both
-- and records the step; its old value also says whether control items wait ('!' appended by
-- `tell_owner`). Then it writes what the worker laid out: one field of its tail hash for
-- the step (the chunks that joined requests' tails, `progress.tail_entry`; the step fields
-- no tail needs any more go), one SPUBLISH per feed (all its chunks in one message), and per flush
-- (a flush, a hand-off, the end) out:{id} gets the tail and the chunk and the progress's
-- counts move; a hand-off also queues the next stage's task and acks the entry, an end acks
-- it, writes the record's final fields, counts the request's usage (`lua/usage.lua`: in
-- this fenced call, so a refused or repeated step counts nothing) and drops the progress.
-- The caller's control list
-- (cancels and feed changes of what it holds) comes back when items wait or the previous step
-- got some: the `acked` items it got with its previous step are dropped first, so an item
-- whose reply was lost comes again.
-- Returns {status, control items}: status 1 written, 2 a repeat of a written step (nothing
-- written), 0 fenced (nothing written: the worker drops everything and comes back as a new
-- consumer), 3 behind (nothing written: the fence holds a step number below ARGV[14], the
-- last step the worker had written: a promoted replica lacks the lost primary's last steps,
-- or a restarted Valkey lost them, or the server's admission count is below ARGV[15]: it lost
-- an admission of the caller; the worker repairs what they held, then steps on).
-- KEYS: 1 work stream, 2 next stream (hand-offs), 3 prog hash, 4 the caller's fence key,
--       5 the caller's control list, 6 the caller's tail hash, then per flush req:{id},
--       out:{id}
-- ARGV: 1 group, 2 feed channel prefix, 3 ttl_fields, 4 out ttl s, 5 req ttl s,
--       6 consumer, 7 step number, 8 control items acked, 9 most control items to return,
--       10 the step's tail field ('' when no chunk joins a tail), 11 F feeds, 12 N flushes,
--       13 S step fields to drop, 14 the caller's last written step number (0: no check),
--       15 the caller's admission count (`admit.lua`; 0: no check: behind when the server's
--       count is lower, it lost an admission and with it the entry's delivery),
--       16 the usage hour hash's ttl s (`count_usage`),
--       then the S step numbers, then per feed: its id and its
--       message (framed request id, framed chunk payload per request, `core.messages.frame`),
--       then per flush: request id, entry id, mode ('f' flush, 'd' done, 'h' hand-off),
--       tokens emitted after it, out:{id} payload (the framed tail and chunk), next task
--       payload ('' unless 'h'), R, the R record field/value items
local most = tonumber(ARGV[9])
local seen = redis.call('SET', KEYS[4], ARGV[7], 'KEEPTTL', 'GET')
if not seen then  -- never registered (or pruned): refused like a fenced consumer
  redis.call('DEL', KEYS[4])
  return {0, {}}
end
if string.byte(seen, 1) == 102 then  -- 'f': fenced by a claim
  redis.call('SET', KEYS[4], seen, 'KEEPTTL')
  return {0, {}}
end
local pending = string.byte(seen, -1) == 33  -- '!': control items wait
local last = tonumber(pending and string.sub(seen, 1, -2) or seen)
if last >= tonumber(ARGV[7]) then
  redis.call('SET', KEYS[4], seen, 'KEEPTTL')
  return {2, redis.call('LRANGE', KEYS[5], 0, most - 1)}
end
if last < tonumber(ARGV[14]) then
  redis.call('SET', KEYS[4], seen, 'KEEPTTL')
  return {3, {}}
end
if tonumber(ARGV[15]) > 0 then
  local admitted = redis.call('GET', admitted_key(KEYS[3], ARGV[6]))
  if (tonumber(admitted) or 0) < tonumber(ARGV[15]) then
    redis.call('SET', KEYS[4], seen, 'KEEPTTL')
    return {3, {}}
  end
end
local control = {}
if tonumber(ARGV[8]) > 0 then redis.call('LTRIM', KEYS[5], tonumber(ARGV[8]), -1) end
if pending or tonumber(ARGV[8]) > 0 then control = redis.call('LRANGE', KEYS[5], 0, most - 1) end
local group, feed_prefix, ttl_fields = ARGV[1], ARGV[2], ARGV[3]
local out_ttl, req_ttl = tonumber(ARGV[4]), tonumber(ARGV[5])
local f, n, s = tonumber(ARGV[11]), tonumber(ARGV[12]), tonumber(ARGV[13])
local usage_ttl = tonumber(ARGV[16])
local at = 17
if ARGV[10] ~= '' then
  redis.call('HSET', KEYS[6], ARGV[7], ARGV[10])
  -- the hash outlives a consumer that vanished (claims and prune set a day too)
  if tonumber(ARGV[7]) % 64 == 1 then redis.call('EXPIRE', KEYS[6], 86400) end
end
if s > 0 then redis.call('HDEL', KEYS[6], unpack(ARGV, at, at + s - 1)) end
at = at + s
for _ = 1, f do
  redis.call('SPUBLISH', feed_prefix .. ARGV[at], ARGV[at + 1])
  at = at + 2
end
local acks = {}
for i = 1, n do
  local rid, entry, mode, emitted = ARGV[at], ARGV[at + 1], ARGV[at + 2], ARGV[at + 3]
  local task_at = at + 5
  local nf = tonumber(ARGV[task_at + 1])
  local req, out = KEYS[5 + 2 * i], KEYS[6 + 2 * i]
  redis.call('XADD', out, '*', ${MESSAGE_FIELD}, ARGV[at + 4])
  redis.call('HSET', req, ${EMITTED}, emitted, ${COMPLETION_TOKENS}, emitted,
    unpack(ARGV, task_at + 2, task_at + 1 + nf))
  acks[#acks + 1] = entry
  if mode == 'd' then
    count_usage(KEYS[3], req, rid, emitted, usage_ttl)
    redis.call('EXPIRE', out, out_ttl)
    redis.call('EXPIRE', req, req_ttl)
    redis.call('HDEL', KEYS[3], rid)
  else
    local p = prog_parse(redis.call('HGET', KEYS[3], rid))
    if p then
      p.emitted, p.hist = emitted, emitted
      if mode == 'h' then p.owner = '' end
      prog_store(KEYS[3], {rid, prog_encode(p)}, ttl_fields)
    end
    if mode == 'h' then
      redis.call('XADD', KEYS[2], '*', ${MESSAGE_FIELD}, ARGV[task_at])
    else
      acks[#acks] = nil
    end
  end
  at = task_at + 2 + nf
end
if #acks > 0 then redis.call('XACK', KEYS[1], group, unpack(acks)) end
return {1, control}
