-- A worker with room moves the best entries of its work stream's wait set into the stream
-- before it reads (ordered.lua): the age-bound ones first (oldest first), then by priority,
-- then by start tag.
-- KEYS: 1 the work stream
-- ARGV: 1 group, 2 most entries the caller will read, 3 a priority bound ('': none; else the
--       caller is full and reads only to displace what it holds: at most that many entries
--       are moved, of a priority below it, or of it and another tenant than ARGV[4]), 4 the
--       tenant holding the most of the caller's slots at that priority ('': none crowds it)
-- Returns how many entries the caller should read: with room, those now unread (at most the
-- count); with a bound, every unread entry when one of them or a moved one qualifies
-- (entries wait unread only while every worker is full: taking them costs no other worker
-- anything), else 0.
local stream, group = KEYS[1], ARGV[1]
local w = stream .. ':wait'
local most = tonumber(ARGV[2])
local below, crowded = nil, ARGV[4]
if ARGV[3] ~= '' then below = tonumber(ARGV[3]) end
local function displaces(priority, tenant)  -- worth taking for a full caller
  return priority < below or (priority == below and crowded ~= '' and tenant ~= crowded)
end
local info = group_of(stream, group)
local lag = lag_of(stream, info, most + 1000)
if redis.call('EXISTS', w .. ':m') == 0 and not below then return math.min(lag, most) end
if not below then most = most - lag end
local now = now_ms()
local moved = 0
while moved < most do
  local token, band = nil, nil
  local aged = {}
  if not below then
    aged = redis.call('ZRANGEBYSCORE', w .. ':age', '-inf', now, 'LIMIT', 0, 1)
  end
  if #aged > 0 then
    token = aged[1]
    band = redis.call('HGET', w .. ':info', token)
  else
    local first = redis.call('ZRANGE', w .. ':bands', 0, 0, 'WITHSCORES')
    if #first == 0 then break end
    band = first[1]
    if below and tonumber(first[2]) > below then break end
    token = redis.call('ZRANGE', w .. ':b:' .. band, 0, 0)[1]
    if below and token then
      if not displaces(tonumber(first[2]), redis.call('HGET', w .. ':tenant', token) or '') then
        break
      end
    end
    if not token then  -- an empty band (never left behind; repaired rather than looped on)
      redis.call('ZREM', w .. ':bands', band)
      token = ''
    end
  end
  local payload = token ~= '' and redis.call('HGET', w .. ':m', token)
  local tenant = token ~= '' and redis.call('HGET', w .. ':tenant', token) or ''
  redis.call('HDEL', w .. ':m', token)
  redis.call('HDEL', w .. ':info', token)
  redis.call('HDEL', w .. ':tenant', token)
  redis.call('ZREM', w .. ':age', token)
  if band then
    local tag = redis.call('ZSCORE', w .. ':b:' .. band, token)
    if tag and tonumber(tag) > tonumber(redis.call('GET', w .. ':v') or '0') then
      redis.call('SET', w .. ':v', tag)  -- the virtual time only moves forward
    end
    redis.call('ZREM', w .. ':b:' .. band, token)
    if redis.call('ZCARD', w .. ':b:' .. band) == 0 then redis.call('ZREM', w .. ':bands', band) end
  end
  if payload then
    redis.call('XADD', stream, '*', ${MESSAGE_FIELD}, payload, 'p', band or '0', 't', tenant)
    moved = moved + 1
  end
end
if not below or moved > 0 then return lag + moved end
if lag == 0 then return 0 end
-- nothing in the wait set qualifies: does an unread entry?
local after = '-'
if info then after = '(' .. info['last-delivered-id'] end
for _, e in ipairs(redis.call('XRANGE', stream, after, '+', 'COUNT', lag)) do
  local fields, priority, tenant = e[2], nil, ''
  for i = 1, #fields, 2 do
    if fields[i] == 'p' then priority = tonumber(fields[i + 1]) end
    if fields[i] == 't' then tenant = fields[i + 1] end
  end
  if priority and displaces(priority, tenant) then return lag end
end
return 0
