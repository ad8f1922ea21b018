-- DELETE /v1/responses/{id} (pipeline/server/response_store.py): the answer replaced by a
-- tombstone that expires when the answer would have.
-- KEYS[1] resp:{id}; ARGV[1] the tombstone's field, ARGV[2] the owner's field, ARGV[3] the
-- caller's key id. 1 deleted, 0 no such response for that key (unknown, expired, deleted,
-- another key's).
if redis.call('HGET', KEYS[1], ARGV[2]) ~= ARGV[3] then return 0 end
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1 then return 0 end
local ttl = redis.call('PTTL', KEYS[1])
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], ARGV[1], '1', ARGV[2], ARGV[3])
if ttl > 0 then redis.call('PEXPIRE', KEYS[1], ttl) end
return 1
