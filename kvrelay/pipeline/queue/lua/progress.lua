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

-- The tail of request `rid` (chunk payloads from token `hist` up to `emitted`, in order) and
-- the fields holding them: each chunk's token count (MessagePack `token_ids`) says where the
-- next one starts. Only readers that attach, claims and dead letters walk it.
local function tail_chunks(prog, rid, hist, emitted)
  local chunks, fields = {}, {}
  local at = hist
  while at < emitted do
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
  return chunks, fields
end
