-- A worker's heartbeat: its worker:{name} hash (with TTL, `draining` mirroring the admin's
-- `drain` flag) and its consumer's beat in the consumers hash, in server time (the lease
-- `claim.lua` checks: no worker clock involved). A fenced consumer (claimed from) beats no
-- more; `first` registers a new consumer: its fence key starts at step number 0.
-- KEYS: 1 worker:{name}, 2 consumers hash, 3 the consumer's fence key
-- ARGV: 1 ttl s, 2 consumer, 3 first ("1" for a consumer's first beat), 4.. worker hash
--       field/value items
-- Returns {1 when the worker is asked to drain else 0, 1 when the consumer is fenced else 0}.
local t = redis.call('TIME')
local drain = redis.call('HGET', KEYS[1], ${WORKER.DRAIN})
local draining = (drain and drain ~= '' and drain ~= '0') and 1 or 0
redis.call('HSET', KEYS[1], ${WORKER.DRAINING}, draining, unpack(ARGV, 4))
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[1]))
local seen
if ARGV[3] == '1' then
  seen = redis.call('SET', KEYS[3], 0, 'NX', 'GET') or '0'
else
  seen = redis.call('GET', KEYS[3])
end
if not seen or string.byte(seen, 1) == 102 then return {draining, 1} end
redis.call('HSET', KEYS[2], ARGV[2], tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000))
return {draining, 0}
