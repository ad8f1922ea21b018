-- Release entries: make those this consumer still owns look idle for a whole lease, so the
-- next XAUTOCLAIM takes them at once (shutdown, engine failure); never touch one another
-- consumer has claimed. XCLAIM JUSTID does not count a delivery.
-- KEYS: 1 work stream. ARGV: 1 group, 2 consumer, 3 idle ms, 4.. entry ids.
for i = 4, #ARGV do
  if owns(KEYS[1], ARGV[1], ARGV[i], ARGV[2]) then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'IDLE', ARGV[3], 'JUSTID')
  end
end
return 0
