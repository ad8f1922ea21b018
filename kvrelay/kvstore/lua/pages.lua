-- The page directory's writes of one flush: add this node to the holders of some pages and
-- drop holders from others, in one call (a page's value lists its holders, comma-separated).
-- KEYS: 1 pages hash
-- ARGV: 1 node id, 2 number A of pages added, the A page keys (hex), then page, node pairs
--       to remove
local node, adds = ARGV[1], tonumber(ARGV[2])
local fields = {}
for i = 3, #ARGV do
  if i < 3 + adds or (i - 3 - adds) % 2 == 0 then fields[#fields + 1] = ARGV[i] end
end
if #fields == 0 then return 0 end
local values = redis.call('HMGET', KEYS[1], unpack(fields))
local holders = {}
for i, page in ipairs(fields) do
  local set = {}
  for h in string.gmatch(values[i] or '', '[^,]+') do set[h] = true end
  holders[page] = set
end
for i = 3, 2 + adds do holders[ARGV[i]][node] = true end
for i = 3 + adds, #ARGV, 2 do holders[ARGV[i]][ARGV[i + 1]] = nil end
local sets, dels = {}, {}
for page, set in pairs(holders) do
  local list = {}
  for h in pairs(set) do list[#list + 1] = h end
  table.sort(list)
  if #list == 0 then
    dels[#dels + 1] = page
  else
    sets[#sets + 1] = page
    sets[#sets + 1] = table.concat(list, ',')
  end
end
if #sets > 0 then redis.call('HSET', KEYS[1], unpack(sets)) end
if #dels > 0 then redis.call('HDEL', KEYS[1], unpack(dels)) end
return #fields
