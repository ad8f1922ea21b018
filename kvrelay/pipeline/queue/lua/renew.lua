-- Lease renewal: reset the idle time of entries this consumer still owns (XCLAIM JUSTID does not
-- count a delivery); never take back an entry another consumer has claimed.
-- KEYS: 1 work stream. ARGV: 1 group, 2 consumer, 3.. entry ids. Returns the ids it lost.
local lost = {}
for i = 3, #ARGV do
  if owns(KEYS[1], ARGV[1], ARGV[i], ARGV[2]) then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
  else
    table.insert(lost, ARGV[i])
  end
end
return lost
