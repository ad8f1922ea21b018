-- Claim the entries of dead consumers: those whose worker has not beaten (consumers hash,
-- server time) for a lease, and those the claimant names as dead (ARGV 8..: the consumers of
-- a worker of its own name on its own host whose process is gone, known at its start). Live workers renew nothing per entry: their heartbeat is the
-- lease, so XPENDING and XCLAIM run only when a consumer is found dead. A dead consumer is
-- fenced first (its fence key `<fence prefix><consumer>` becomes 'f', kept a day: every later
-- step of it is refused wholesale), so no write of it lands after its entries change hands.
-- One that owns nothing more, in this stream or the other stage's (the consumers hash serves
-- both: a prefill worker's scan must not forget a dead decode consumer), leaves the hash.
-- KEYS: 1 work stream, 2 consumers hash, 3 the other stage's stream
-- ARGV: 1 group, 2 claiming consumer, 3 lease ms, 4 most entries to claim, 5 fence key prefix,
--       6 the other stream's group, 7 tail hash key prefix, 8.. consumers known dead
-- Returns {entry id, payload or false, deliveries} per claimed entry.
local group, me, lease_ms, room = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local beats = redis.call('HGETALL', KEYS[2])
local dead = {}
for i = 8, #ARGV do dead[ARGV[i]] = true end
local claimed = {}
for i = 1, #beats, 2 do
  local name, beat_ms = beats[i], tonumber(beats[i + 1]) or 0
  if name ~= me and (now_ms - beat_ms > lease_ms or dead[name]) and room > 0 then
    redis.call('SET', ARGV[5] .. name, 'f', 'EX', 86400)
    -- its tail hash stays until the requests claimed from it are admitted (which moves
    -- their tails to out:{id}): a day, like the fence
    redis.call('EXPIRE', ARGV[7] .. name, 86400)
    local pending = redis.call('XPENDING', KEYS[1], group, '-', '+', room, name)
    if #pending == 0 then
      local other = redis.pcall('XPENDING', KEYS[3], ARGV[6], '-', '+', 1, name)
      if type(other) ~= 'table' or other.err or #other == 0 then
        redis.call('HDEL', KEYS[2], name)
      end
    else
      local ids, counts = {}, {}
      for _, row in ipairs(pending) do
        ids[#ids + 1] = row[1]
        counts[row[1]] = tonumber(row[4]) + 1
      end
      for _, entry in ipairs(redis.call('XCLAIM', KEYS[1], group, me, 0, unpack(ids))) do
        local id, fields = entry[1], entry[2]
        local payload = false
        if type(fields) == 'table' then
          for k = 1, #fields, 2 do
            if fields[k] == ${MESSAGE_FIELD} then payload = fields[k + 1] end
          end
        end
        claimed[#claimed + 1] = {id, payload, counts[id] or 1}
        room = room - 1
      end
    end
  end
end
return claimed
