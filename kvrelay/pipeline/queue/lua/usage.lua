-- Usage accounting (`core.usage`; docs/operations.md "Usage accounting"): `count_usage` is
-- called by the step script for each request it ends (mode 'd'), after the end's record fields
-- are written, so a refused (fenced) or repeated step counts nothing and a resumed, retried or
-- migrated request counts once. It adds the request's numbers, as its record holds them (the
-- ones its final chunk's usage carries: prompt_tokens, cached_tokens, and the tokens emitted),
-- to this shard's hash of the current hour (expiring `ttl` seconds after its last count) and
-- to its total hash, field `<metric> <account>`. A choice of a request of several
-- (`per_prompt` set: its id ends `.k`) counts its prompt (and cached) tokens when k is a
-- multiple of per_prompt, and the request when k is 0, as the client's usage counts them. A
-- record without an account (submitted by the producer client) counts to key and tenant "".
local function count_usage(prog, req, rid, completion, ttl)
  local got = redis.call('HMGET', req, ${STATUS}, ${PROMPT_TOKENS}, ${CACHED_TOKENS},
    ${ACCOUNT}, ${PER_PROMPT}, ${MODEL})
  local account = got[4] or ('["","",' .. cjson.encode(got[6] or '') .. ']')
  local request, prompt = true, true
  local per = tonumber(got[5])
  if per and per > 0 then
    local k = tonumber(string.match(rid, '%.(%d+)$')) or 0
    request, prompt = k == 0, k % per == 0
  end
  local counts
  if got[1] == ${STATUS.FAILED} then
    counts = {${USAGE.FAILED_REQUESTS}, ${USAGE.FAILED_PROMPT_TOKENS},
      ${USAGE.FAILED_CACHED_TOKENS}, ${USAGE.FAILED_COMPLETION_TOKENS}}
  else
    counts = {${USAGE.REQUESTS}, ${USAGE.PROMPT_TOKENS}, ${USAGE.CACHED_TOKENS},
      ${USAGE.COMPLETION_TOKENS}}
  end
  local values = {
    request and 1 or 0,
    prompt and (tonumber(got[2]) or 0) or 0,
    prompt and (tonumber(got[3]) or 0) or 0,
    tonumber(completion) or 0,
  }
  local now = tonumber(redis.call('TIME')[1])  -- the hour: core.usage.PERIOD_S
  local base = string.sub(prog, 1, #prog - 4) .. 'usage:'
  local hour, total = base .. (now - now % 3600), base .. 'total'
  for i = 1, 4 do
    if values[i] > 0 then
      local name = counts[i] .. ' ' .. account
      redis.call('HINCRBY', hour, name, values[i])
      redis.call('HINCRBY', total, name, values[i])
    end
  end
  if ttl > 0 then redis.call('EXPIRE', hour, ttl) end
end
