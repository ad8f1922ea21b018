-- Shared prelude (prepended to every fenced script): does `consumer` own entry `id`?
local function owns(stream, group, id, consumer)
  local pending = redis.pcall('XPENDING', stream, group, id, id, 1)
  if type(pending) ~= 'table' or pending.err or pending[1] == nil then
    return false
  end
  return pending[1][2] == consumer
end

local function hset_pairs(key, argv, first)
  if #argv >= first then
    redis.call('HSET', key, unpack(argv, first, #argv))
  end
end
