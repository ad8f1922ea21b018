-- Shared prelude: a request's progress value in the `prog` hash (kvrelay/pipeline/queue/progress.py
-- documents the layout: five lines) and its tail, the chunks not yet in out:{id}, one field
-- `<request id>#<chunk index>` each in the same hash ('#' is no request id character).
-- the five lines: emitted, hist, cancel, feeds, owner (string.match gives them as strings)
local PROG_LINES = '^(%d+)\n(%d+)\n(.)\n([^\n]*)\n([^\n]*)'

local function prog_join(emitted, hist, cancel, feeds, owner)
  return emitted .. '\n' .. hist .. '\n' .. cancel .. '\n' .. feeds .. '\n' .. owner
end

local function prog_parse(value)
  if not value then return nil end
  local e, h, c, f, o = string.match(value, PROG_LINES)
  if not e then return nil end
  return {emitted = tonumber(e), hist = tonumber(h), cancel = c, feeds = f, owner = o}
end

local function prog_encode(p)
  return prog_join(p.emitted, p.hist, p.cancel, p.feeds, p.owner)
end

-- Write hash fields (a flat field/value list) keeping each field's time to live where the
-- server has field expiry (`ttl_fields` "1": Valkey 9 / Redis 8 HSETEX), plain HSET elsewhere.
local function prog_store(key, items, ttl_fields)
  if #items == 0 then return end
  if ttl_fields == '1' then
    redis.call('HSETEX', key, 'KEEPTTL', 'FIELDS', #items / 2, unpack(items))
  else
    redis.call('HSET', key, unpack(items))
  end
end

local function frame(payload)
  return struct.pack('>I4', #payload) .. payload
end

-- A consumer's tail hash (`tail:{consumer}` next to the prog hash, Keys.tail): step number ->
-- the chunks that step added to requests' tails (`progress.tail_entry`: a framed header of
-- lines `\n<request id> <offset> <length>`, then the chunk payloads).
local function tail_key(prog, consumer)
  return string.sub(prog, 1, #prog - 4) .. 'tail:' .. consumer
end

local function owner_consumer(owner)
  return string.match(owner or '', '^(.*)/[^/]*$')
end

-- Request `rid`'s chunk payload in one step's tail entry, or nil.
local function tail_entry_chunk(entry, rid)
  local n = struct.unpack('>I4', entry, 1)
  local header = string.sub(entry, 5, 4 + n)
  local at = string.find(header, '\n' .. rid .. ' ', 1, true)
  if not at then return nil end
  local offset, length = string.match(header, '^(%d+) (%d+)', at + #rid + 2)
  return string.sub(entry, 5 + n + offset, 4 + n + offset + length)
end

-- The decoded chunk (a table with `index` and `token_ids`) or nil. A chunk leaves out the
-- fields at their defaults (`TokenChunk`): no `index` is 0.
local function chunk_of(payload)
  local ok, chunk = pcall(cmsgpack.unpack, payload)
  if not ok or type(chunk) ~= 'table' or chunk.t ~= 'chunk' then return nil end
  chunk.index = chunk.index or 0
  if type(chunk.index) ~= 'number' then return nil end
  return chunk
end

-- Request `rid`'s chunks in the tail hash of its owner, newest step first: calls
-- visit(payload, chunk) until it returns true. None without an owner (a request changing
-- hands has its tail moved to out:{id}).
local function walk_tail(prog, rid, p, visit)
  local consumer = owner_consumer(p.owner)
  if not consumer or consumer == '' then return end
  local key = tail_key(prog, consumer)
  local steps = redis.call('HKEYS', key)
  for i = 1, #steps do steps[i] = tonumber(steps[i]) end
  table.sort(steps, function(a, b) return a > b end)
  for first = 1, #steps, 32 do
    local some = {}
    for i = first, math.min(first + 31, #steps) do some[#some + 1] = steps[i] end
    for _, entry in ipairs(redis.call('HMGET', key, unpack(some))) do
      local payload = entry and tail_entry_chunk(entry, rid)
      local chunk = payload and chunk_of(payload)
      if chunk and visit(payload, chunk) then return end
    end
  end
end

-- The tail of request `rid` whose progress is `p`: its chunk payloads from token `p.hist` on,
-- in order (each chunk's token count says where the next one starts; they end at the first
-- one missing), and the tokens emitted (where they end). Walks the owner's step fields from
-- the newest until it reaches `hist`. Only readers that attach, admissions of claimed
-- requests, releases and dead letters read a tail, never a step.
local function tail_chunks(prog, rid, p)
  local found = {}  -- chunk index -> {payload, decoded chunk}
  walk_tail(prog, rid, p, function(payload, chunk)
    found[chunk.index] = {payload, chunk}
    return chunk.index <= p.hist
  end)
  local chunks, at = {}, p.hist
  while found[at] do
    local payload, chunk = found[at][1], found[at][2]
    local n = type(chunk.token_ids) == 'table' and #chunk.token_ids or 0
    chunks[#chunks + 1] = payload
    if n == 0 then break end
    at = at + n
  end
  return chunks, at
end

-- The tokens emitted so far by request `rid` (its tail's end, else `p.hist`): the newest of
-- its chunks in the owner's step fields (live counts, strikes).
local function tail_end(prog, rid, p)
  local at = p.hist
  walk_tail(prog, rid, p, function(_payload, chunk)
    local n = type(chunk.token_ids) == 'table' and #chunk.token_ids or 0
    if chunk.index + n > at then at = chunk.index + n end
    return true
  end)
  return at
end

-- Move a request's tail to out:{id} (its owner changes: admission by another consumer, a
-- release): after it, the progress counts it as history. Returns the progress, changed.
local function move_tail(prog, out, rid, p)
  local chunks, at = tail_chunks(prog, rid, p)
  if #chunks > 0 then
    local run = {}
    for i, chunk in ipairs(chunks) do run[i] = frame(chunk) end
    redis.call('XADD', out, '*', ${MESSAGE_FIELD}, table.concat(run))
  end
  p.emitted, p.hist = at, at
  return p
end

-- The control list of a worker's consumer (cancels and feed changes of the requests it owns,
-- popped by its step script): `control:{consumer}` next to the prog hash (Keys.control).
local function control_key(prog, consumer)
  return string.sub(prog, 1, #prog - 4) .. 'control:' .. consumer
end

-- The count of a consumer's admissions (`admitted:{consumer}` next to the prog hash,
-- `Streams.admitted_key`): each admission call adds one (`admit.lua`), and a step whose caller
-- knows of more than the server holds is refused as behind (`step.lua`): a promoted replica
-- that lacks an admission lacks its delivery too, and another worker may read the entry.
local function admitted_key(prog, consumer)
  return string.sub(prog, 1, #prog - 4) .. 'admitted:' .. consumer
end

-- Tell the owner (`consumer/entry id`, '' = none) of a request something (`cancel <id>`,
-- `feeds <id> <f1,f2>`); the list expires when no live owner reads it. A '!' on the owner's
-- fence key (`fence:{consumer}`, Keys.fence) makes its next step read the list.
local function tell_owner(prog, owner, message)
  local consumer = string.match(owner, '^(.*)/[^/]*$')
  if not consumer or consumer == '' then return end
  local key = control_key(prog, consumer)
  redis.call('RPUSH', key, message)
  redis.call('EXPIRE', key, 3600)
  local fence = string.sub(prog, 1, #prog - 4) .. 'fence:' .. consumer
  local seen = redis.call('GET', fence)
  if seen and string.byte(seen, -1) ~= 33 then redis.call('APPEND', fence, '!') end
end
