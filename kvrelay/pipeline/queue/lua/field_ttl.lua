-- Probe: 1 when the server has HSETEX (per-field hash expiry: Valkey 9, Redis 8), else 0
-- (redis-py cannot parse `COMMAND INFO` of a command the server lacks).
local info = redis.call('COMMAND', 'INFO', 'HSETEX')
return (info[1] and 1) or 0
