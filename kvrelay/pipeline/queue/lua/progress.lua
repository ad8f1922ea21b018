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

-- The tail of request `rid` (chunk payloads from token `hist` on, in order) and the fields
-- holding them: each chunk's token count (MessagePack `token_ids`) says where the next one
-- starts; the walk ends at the first missing field (workers write tail fields without touching
-- the progress, whose `emitted` moves only at flushes). Returns chunks, fields and the tokens
-- emitted (where the walk ended). Only readers that attach, claims and dead letters walk it.
local function tail_chunks(prog, rid, hist)
  local chunks, fields = {}, {}
  local at = hist
  while true do
    local field = rid .. '#' .. at
    local payload = redis.call('HGET', prog, field)
    if not payload then break end
    local ok, chunk = pcall(cmsgpack.unpack, payload)
    local n = ok and type(chunk) == 'table' and type(chunk.token_ids) == 'table'
      and #chunk.token_ids or 0
    chunks[#chunks + 1] = payload
    fields[#fields + 1] = field
    if n == 0 then break end
    at = at + n
  end
  return chunks, fields, at
end

-- The control list of a worker's consumer (cancels and feed changes of the requests it owns,
-- popped by its step script): `control:{consumer}` next to the prog hash (Keys.control).
local function control_key(prog, consumer)
  return string.sub(prog, 1, #prog - 4) .. 'control:' .. consumer
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
