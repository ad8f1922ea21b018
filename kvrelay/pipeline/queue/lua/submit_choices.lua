-- Queue a request answered by several choices (n, best_of, a list of prompts): create its
-- parent record req:{id} and, per choice, the choice's record req:{id}.{k}, progress and task,
-- all or nothing, unless the streams are too backed up to take them all. As submit.lua, in
-- one step.
-- KEYS: 1 parent req:{id}, 2 prefill stream, 3 decode stream, 4 the prog hash,
--       5.. the choices' req:{id}.{k}
-- ARGV: 1 ttl s, 2 max_waiting (0: no bound), 3 prefill group, 4 decode group,
--       5 submission id, 6 number of choices N, 7 each choice's progress value (naming the
--       feed of the reader that follows them), 8 ttl_fields ("1": HSETEX), 9 ordered ('1':
--       in order, ordered.lua; ''), 10 priority, 11 tenant, 12 cost of each choice, 13 age
--       bound ms, 14 number P of parent field/value items, then the P items, then per choice: stream ('p' | 'd'), its
--       request id, payload, number M of field/value items, the M items
-- Returns the last entry id ('in-wait-set' when it waits in a wait set); the submission id when this submission is already queued (a
-- retry whose reply was lost); false when a record already exists (a duplicate id); the number
-- of waiting entries when the choices do not fit under max_waiting (an empty queue takes
-- any request, so one with more choices than the bound is not refused forever).
if redis.call('EXISTS', KEYS[1]) == 1 then
  if redis.call('HGET', KEYS[1], ${SUBMISSION_ID}) == ARGV[5] then return ARGV[5] end
  return false
end
local count = tonumber(ARGV[6])
for i = 1, count do
  if redis.call('EXISTS', KEYS[4 + i]) == 1 then return false end
end
local bound = tonumber(ARGV[2])
if bound > 0 then
  local n = waiting(KEYS[2], ARGV[3], bound)
  if n < bound then n = n + waiting(KEYS[3], ARGV[4], bound - n) end
  if n > 0 and n + count > bound then return n end
end
local ttl = tonumber(ARGV[1])
local at = 15 + tonumber(ARGV[14])
redis.call('HSET', KEYS[1], ${SUBMISSION_ID}, ARGV[5], unpack(ARGV, 15, at - 1))
redis.call('EXPIRE', KEYS[1], ttl)
local order = nil
if ARGV[9] == '1' then order = {ARGV[10], ARGV[11], ARGV[12], ARGV[13]} end
local progress = {}
local last = false
for i = 1, count do
  local stream = ARGV[at] == 'p' and KEYS[2] or KEYS[3]
  local group = ARGV[at] == 'p' and ARGV[3] or ARGV[4]
  local id, payload, items = ARGV[at + 1], ARGV[at + 2], tonumber(ARGV[at + 3])
  local key = KEYS[4 + i]
  redis.call('HSET', key, ${SUBMISSION_ID}, ARGV[5], unpack(ARGV, at + 4, at + 3 + items))
  redis.call('EXPIRE', key, ttl)
  table.insert(progress, id)
  table.insert(progress, ARGV[7])
  last = queue_on(stream, group, payload, id, order)
  at = at + 4 + items
end
if ARGV[8] == '1' then
  redis.call('HSETEX', KEYS[4], 'EX', ttl, 'FIELDS', count, unpack(progress))
else
  redis.call('HSET', KEYS[4], unpack(progress))
end
return last
