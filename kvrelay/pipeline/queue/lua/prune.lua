-- Delete a consumer only if it still owns nothing, checked atomically: DELCONSUMER drops the
-- consumer's pending entries from the group, so an entry read in between would be lost.
-- KEYS: 1 work stream. ARGV: 1 group, 2 consumer. Returns -1 (kept) or DELCONSUMER's reply.
if #redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', 1, ARGV[2]) > 0 then return -1 end
return redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], ARGV[2])
