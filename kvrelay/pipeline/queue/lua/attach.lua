-- Attach an output reader to a request: add its feed to the request's progress (the newest
-- MAX_FEEDS kept), tell its owner (`feeds <id> <f1,f2>` on its control list) and read the
-- history, in one step. The owner learns the feed at its next step: a chunk it writes before
-- then reaches the reader through the tail (the gap at the next chunk, or the quiet check).
-- KEYS: 1 the prog hash, 2 out:{id}
-- ARGV: 1 request id, 2 feed (reader) id ("" reads only), 3 max feeds, 4 ttl_fields ("1": HSETEX)
-- Returns {progress value or false (no progress: the request ended, or never ran), the `m`
-- values of out:{id} in order (each one or more framed chunks), the tail's chunk payloads}.
local value = redis.call('HGET', KEYS[1], ARGV[1])
local p = prog_parse(value)
if p and ARGV[2] ~= '' then
  local feeds, known = {}, false
  for f in string.gmatch(p.feeds, '[^,]+') do
    if f == ARGV[2] then known = true end
    table.insert(feeds, f)
  end
  if not known then
    table.insert(feeds, ARGV[2])
    while #feeds > tonumber(ARGV[3]) do table.remove(feeds, 1) end
    p.feeds = table.concat(feeds, ',')
    value = prog_encode(p)
    prog_store(KEYS[1], {ARGV[1], value}, ARGV[4])
    tell_owner(KEYS[1], p.owner, 'feeds ' .. ARGV[1] .. ' ' .. p.feeds)
  end
end
local history = {}
for _, entry in ipairs(redis.call('XRANGE', KEYS[2], '-', '+')) do
  local fields = entry[2]
  for i = 1, #fields, 2 do
    if fields[i] == ${MESSAGE_FIELD} then table.insert(history, fields[i + 1]) end
  end
end
local tail = {}
if p then tail = tail_chunks(KEYS[1], ARGV[1], p) end
return {value or false, history, tail}
