-- Admission of a batch of entries a worker just read or claimed: each request's progress names
-- the worker as its owner (from here on only its writes land) and the record says who has it.
-- A request without progress gets one (a task queued with tokens already emitted counts them
-- as history), unless its record says it ended: then nothing is written. A request that had
-- an owner (claimed from a dead one, or taken back) has its tail moved to out:{id} first: the
-- tail is in its owner's tail hash, and the new owner writes its own.
-- KEYS: 1 prog hash, then per entry req:{id}, out:{id}
-- ARGV: 1 consumer, 2 ttl_fields, 3 N entries, then per entry: entry id, request id, tokens
--       the task carries, number F of record field/value items, the F items
-- Each call adds one to the consumer's admission count (`admitted_key`), which its steps
-- check: a server that lost an admission (a failover) refuses them until the worker repaired.
-- Returns per entry {emitted at its last flush, cancel flag (0/1), the feeds following it},
-- or {-1, status} when it ended; then the consumer's admission count.
local consumer, ttl_fields, n = ARGV[1], ARGV[2], tonumber(ARGV[3])
local entries, ids, at = {}, {}, 4
for i = 1, n do
  local e = {entry = ARGV[at], rid = ARGV[at + 1], queued = tonumber(ARGV[at + 2]),
             nf = tonumber(ARGV[at + 3]), first = at + 4}
  at = at + 4 + e.nf
  entries[i] = e
  ids[i] = e.rid
end
local values = redis.call('HMGET', KEYS[1], unpack(ids))
local out, stores = {}, {}
for i = 1, n do
  local e = entries[i]
  local p = prog_parse(values[i])
  local ended = nil
  if not p then
    local status = redis.call('HGET', KEYS[2 * i], ${STATUS})
    if status == ${STATUS.FINISHED} or status == ${STATUS.CANCELLED} or status == ${STATUS.FAILED} then
      ended = status
    else
      p = {emitted = e.queued, hist = e.queued, cancel = '0', feeds = '', owner = ''}
    end
  end
  if ended then
    out[i] = {-1, ended}
  else
    if p.owner ~= '' then p = move_tail(KEYS[1], KEYS[2 * i + 1], e.rid, p) end
    p.owner = consumer .. '/' .. e.entry
    stores[#stores + 1] = e.rid
    stores[#stores + 1] = prog_encode(p)
    if e.nf > 0 then redis.call('HSET', KEYS[2 * i], unpack(ARGV, e.first, e.first + e.nf - 1)) end
    out[i] = {p.emitted, p.cancel == '1' and 1 or 0, p.feeds}
  end
end
prog_store(KEYS[1], stores, ttl_fields)
local admitted = admitted_key(KEYS[1], consumer)
out[n + 1] = redis.call('INCR', admitted)
redis.call('EXPIRE', admitted, 86400)  -- like the fence and the tail hash
return out
