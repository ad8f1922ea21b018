-- The live progress of requests: each one's progress value with `emitted` counted up to the
-- end of its tail (the stored count moves only at flushes; workers add to tails per step).
-- For status reads (GET /v1/requests/{id}, `kvrelay requests show`), not per token.
-- KEYS: 1 the prog hash
-- ARGV: request ids
-- Returns per id the progress value, or false when it has none.
local out = {}
for i, rid in ipairs(ARGV) do
  local p = prog_parse(redis.call('HGET', KEYS[1], rid))
  if p then
    p.emitted = tail_end(KEYS[1], rid, p)
    out[i] = prog_encode(p)
  else
    out[i] = false
  end
end
return out
