-- A worker's heartbeat: its worker:{name} hash (with TTL, `draining` mirroring the admin's
-- `drain` flag) and its consumer's beat in the consumers hash, in server time (the lease
-- `claim.lua` checks: no worker clock involved). A fenced consumer (claimed from) beats no
-- more; `first` registers a new consumer in the fence hash (step number 0).
-- KEYS: 1 worker:{name}, 2 consumers hash, 3 fence hash
-- ARGV: 1 ttl s, 2 consumer, 3 first ("1" for a consumer's first beat), 4.. worker hash
--       field/value items
-- Returns {1 when the worker is asked to drain else 0, 1 when the consumer is fenced else 0}.
local t = redis.call('TIME')
local drain = redis.call('HGET', KEYS[1], ${WORKER.DRAIN})
local draining = (drain and drain ~= '' and drain ~= '0') and 1 or 0
redis.call('HSET', KEYS[1], ${WORKER.DRAINING}, draining, unpack(ARGV, 4))
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[1]))
if ARGV[3] == '1' then redis.call('HSETNX', KEYS[3], ARGV[2], 0) end
local seen = redis.call('HGET', KEYS[3], ARGV[2])
if not seen or seen == 'f' then return {draining, 1} end
redis.call('HSET', KEYS[2], ARGV[2], tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000))
return {draining, 0}
