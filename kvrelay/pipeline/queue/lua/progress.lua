-- Shared prelude: a request's progress value in the `prog` hash (kvrelay/pipeline/queue/progress.py
-- documents the layout: five header lines, then the framed chunks not yet in out:{id}).
local function prog_parse(value)
  if not value then return nil end
  local p = {}
  local at = 1
  for i = 1, 5 do
    local nl = string.find(value, '\n', at, true)
    if not nl then return nil end
    p[i] = string.sub(value, at, nl - 1)
    at = nl + 1
  end
  return {emitted = tonumber(p[1]), hist = tonumber(p[2]), cancel = p[3], feeds = p[4],
          owner = p[5], tail = string.sub(value, at)}
end

local function prog_encode(p)
  return p.emitted .. '\n' .. p.hist .. '\n' .. p.cancel .. '\n' .. p.feeds .. '\n' ..
    p.owner .. '\n' .. p.tail
end

-- Write progress fields (a flat field/value list) keeping each field's time to live where the
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
