-- Delete a consumer only if it still owns nothing, checked atomically: DELCONSUMER drops the
-- consumer's pending entries from the group, so an entry read in between would be lost.
-- Its fence key goes with it (unless a claim fenced it: that 'f' expires by itself).
-- KEYS: 1 work stream, 2 the consumer's fence key, 3 its tail hash, 4 its admission count.
-- ARGV: 1 group, 2 consumer.
-- Returns -1 (kept) or DELCONSUMER's reply.
if #redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', 1, ARGV[2]) > 0 then return -1 end
local fence = redis.call('GET', KEYS[2])
if fence and string.byte(fence, 1) ~= 102 then redis.call('DEL', KEYS[2]) end
-- its tail hash: gone in a day (a request taken from it moves its tail at its admission)
redis.call('EXPIRE', KEYS[3], 86400)
if KEYS[4] then redis.call('DEL', KEYS[4]) end
return redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], ARGV[2])
