-- Cancel requests: set the `cancel` flag of each one's progress (a worker admitting it sees
-- it) and tell its owner, if any, through its control list (`cancel <id>`, popped by the
-- owner's next step). A request without progress (ended, or unknown) is left alone.
-- KEYS: 1 the prog hash
-- ARGV: 1 ttl_fields ("1": HSETEX KEEPTTL), 2.. request ids
-- Returns the ids whose progress carries the flag now.
local ids = {unpack(ARGV, 2)}
if #ids == 0 then return {} end
local values = redis.call('HMGET', KEYS[1], unpack(ids))
local items, flagged = {}, {}
for i, id in ipairs(ids) do
  local p = prog_parse(values[i])
  if p then
    if p.cancel ~= '1' then
      p.cancel = '1'
      table.insert(items, id)
      table.insert(items, prog_encode(p))
      tell_owner(KEYS[1], p.owner, 'cancel ' .. id)
    end
    table.insert(flagged, id)
  end
end
prog_store(KEYS[1], items, ARGV[1])
return flagged
