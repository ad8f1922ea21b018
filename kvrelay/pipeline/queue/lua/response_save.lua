-- A stored Responses API answer written unless it was deleted (pipeline/server/response_store.py).
-- KEYS[1] resp:{id}; ARGV[1] the tombstone's field, ARGV[2] the time to live (s), then
-- field, value pairs. 1 written, 0 deleted (a tombstone stays).
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV, 3))
redis.call('EXPIRE', KEYS[1], ARGV[2])
return 1
