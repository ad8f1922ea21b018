-- Queue one request: create req:{id} (refusing an id that exists), its progress and XADD its
-- task, unless max_waiting entries no worker has read yet already wait. Checking and queueing
-- in one script makes the bound exact under any burst, from any number of ingress processes.
-- KEYS: 1 req:{id}, 2 work stream, 3 prefill stream, 4 decode stream, 5 the prog hash
-- ARGV: 1 ttl s, 2 payload, 3 max_waiting (0: no bound), 4 prefill group, 5 decode group,
--       6 submission id (random, one per submission), 7 request id, 8 its progress value
--       (naming the feed of the reader that follows it), 9 ttl_fields ("1": HSETEX),
--       10 ordered ('1': queue in order, ordered.lua; '' at the stream's end), 11 priority,
--       12 tenant, 13 cost, 14 age bound ms, 15.. field/value pairs
-- Returns the new entry id ('in-wait-set' when it waits in the stream's wait set); the submission
-- id when this very submission is already queued (a retry whose first try ran but whose reply
-- was lost: nothing is queued twice); false when
-- req:{id} already exists for another submission (a duplicate id); the number of waiting
-- entries when that reaches max_waiting.
local function existing()
  if redis.call('HGET', KEYS[1], ${SUBMISSION_ID}) == ARGV[6] then return ARGV[6] end
  return false
end
local function full()  -- the number waiting when it reaches the bound, else nil
  local bound = tonumber(ARGV[3])
  if bound <= 0 then return nil end
  local n = waiting(KEYS[3], ARGV[4], bound)
  if n < bound then n = n + waiting(KEYS[4], ARGV[5], bound - n) end
  if n >= bound then return n end
  return nil
end
if ARGV[9] == '1' then
  -- HSETEX FNX creates the record only when none of its fields exists: the existence check
  -- and the write in one command (undone when the bound refuses the request)
  local created = redis.call('HSETEX', KEYS[1], 'FNX', 'FIELDS', (#ARGV - 12) / 2,
    ${SUBMISSION_ID}, ARGV[6], unpack(ARGV, 15))
  if created == 0 then return existing() end
  local n = full()
  if n then
    redis.call('DEL', KEYS[1])
    return n
  end
else
  if redis.call('EXISTS', KEYS[1]) == 1 then return existing() end
  local n = full()
  if n then return n end
  redis.call('HSET', KEYS[1], ${SUBMISSION_ID}, ARGV[6], unpack(ARGV, 15))
end
local ttl = tonumber(ARGV[1])
redis.call('EXPIRE', KEYS[1], ttl)
if ARGV[9] == '1' then
  redis.call('HSETEX', KEYS[5], 'EX', ttl, 'FIELDS', 1, ARGV[7], ARGV[8])
else
  redis.call('HSET', KEYS[5], ARGV[7], ARGV[8])
end
local order = nil
if ARGV[10] == '1' then order = {ARGV[11], ARGV[12], ARGV[13], ARGV[14]} end
return queue_on(KEYS[2], KEYS[2] == KEYS[3] and ARGV[4] or ARGV[5], ARGV[2], ARGV[7], order)
