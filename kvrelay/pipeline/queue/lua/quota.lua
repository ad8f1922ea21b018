-- One API key's quotas, checked and taken in one step (pipeline/queue/quota.py): requests and
-- tokens per minute, each counted in a fixed window of ARGV[5] ms that opens with the first
-- request counted in it (a counter whose expiry is the window's end), and requests open at
-- once, each a member of a sorted set scored by the time it lapses (a crashed ingress never
-- gives its units back: they lapse). A request over any limit takes nothing.
-- Time is the server's (TIME), the same for every ingress. Every key has the key's hash tag.
-- KEYS: 1 requests counter, 2 tokens counter, 3 open requests (unit -> lapse time, ms)
-- ARGV: 1 rpm, 2 tpm, 3 max_concurrent (0: no limit), 4 tokens asked, 5 window ms, 6 unit,
--       7 how long a unit is held at most (ms)
-- Returns {refused (bits: 1 requests, 2 tokens, 4 more tokens than tpm, 8 open requests),
--          requests counted, ms left in their window (0: none open), tokens counted, ms left,
--          requests open} (the counts after this request when it was admitted)
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local rpm, tpm, cap = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local tokens, window, hold = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[7])

-- (count, ms left) of a window; a counter without an expiry (never written so) is no window
local function counted(key)
  local left = redis.call('PTTL', key)
  if left <= 0 then return 0, 0 end
  return tonumber(redis.call('GET', key)), left
end

-- the window counts `n` more; a window that is not open opens now
local function count(key, n, left)
  if left > 0 then return redis.call('INCRBY', key, n), left end
  redis.call('SET', key, n, 'PX', window)
  return n, window
end

local nreq, req_left, ntok, tok_left, open = 0, 0, 0, 0, 0
if rpm > 0 then nreq, req_left = counted(KEYS[1]) end
if tpm > 0 then ntok, tok_left = counted(KEYS[2]) end
if cap > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
  open = redis.call('ZCARD', KEYS[3])
end
local refused = 0
if rpm > 0 and nreq + 1 > rpm then refused = refused + 1 end
if tpm > 0 then
  if tokens > tpm then
    refused = refused + 4
  elseif ntok + tokens > tpm then
    refused = refused + 2
  end
end
if cap > 0 and open >= cap then refused = refused + 8 end
if refused == 0 then
  if rpm > 0 then nreq, req_left = count(KEYS[1], 1, req_left) end
  if tpm > 0 then ntok, tok_left = count(KEYS[2], tokens, tok_left) end
  if cap > 0 then
    redis.call('ZADD', KEYS[3], now + hold, ARGV[6])
    redis.call('PEXPIRE', KEYS[3], hold)  -- the newest unit lapses last
    open = open + 1
  end
end
return {refused, nreq, req_left, ntok, tok_left, open}
