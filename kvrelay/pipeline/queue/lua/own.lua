-- The entries pending under a consumer, for its own worker to take back after a Redis error
-- (a lost XREADGROUP or claim reply leaves entries pending under a live consumer that does
-- not hold them: nobody claims a live consumer's entries). XREADGROUP with id 0 would give
-- them too, but it counts one more delivery of each, which the poison count (`strikes.lua`)
-- reads as a holder that died; this reads without counting.
-- KEYS: 1 work stream. ARGV: 1 group, 2 consumer, 3 after this entry id (exclusive; '-' from
-- the first), 4 most entries.
-- Returns {entry id, payload or false, deliveries} per pending entry, in id order (an entry
-- trimmed from the stream comes with false).
local start = ARGV[3] == '-' and '-' or '(' .. ARGV[3]
local rows = redis.call('XPENDING', KEYS[1], ARGV[1], start, '+', tonumber(ARGV[4]), ARGV[2])
local out = {}
for _, row in ipairs(rows) do
  local payload = false
  local entry = redis.call('XRANGE', KEYS[1], row[1], row[1])[1]
  if entry then
    local fields = entry[2]
    for k = 1, #fields, 2 do
      if fields[k] == ${MESSAGE_FIELD} then payload = fields[k + 1] end
    end
  end
  out[#out + 1] = {row[1], payload, row[4]}
end
return out
