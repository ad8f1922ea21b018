-- Prelude of the scripts that queue work (submit, submit_choices) and of refill.lua: the
-- waiting counts and ordered queueing (the ingress's --scheduling-policy priority).
--
-- Ordered queueing: a request goes straight to its work stream only when nothing waits there
-- unread and nothing waits in the stream's wait set; otherwise it waits in the wait set,
-- ordered by priority (lower first), then by start-time fair queuing between tenants: its
-- start tag is max(the virtual time, its tenant's last finish tag), its tenant's finish tag
-- becomes start + cost (prompt tokens + max_tokens, over the tenant's weight), and the virtual
-- time moves to the start tag of each request that leaves. A request waiting past its age
-- bound goes before any priority. Workers move entries into the stream only as they have room
-- (`refill.lua`), so the stream holds what they are about to read, in this order.
-- Keys, beside the stream S (its hash slot): S:wait:m (hash token -> payload), S:wait:bands
-- (zset band -> priority), S:wait:b:<band> (zset token -> start tag), S:wait:age (zset token
-- -> deadline ms), S:wait:info (hash token -> band), S:wait:tenant (hash token -> tenant),
-- S:wait:fin (hash tenant -> finish tag),
-- S:wait:v (the virtual time). A token is the request id. An entry queued in order carries
-- its priority and tenant in fields 'p' and 't', so that a full worker can tell whether an
-- unread one is worth displacing for (refill.lua).
local function group_of(stream, group)  -- the group's XINFO fields; false: no stream; nil: none
  local groups = redis.pcall('XINFO', 'GROUPS', stream)
  if type(groups) == 'table' and groups.err then return false end
  for _, g in ipairs(groups) do
    local info = {}
    for i = 1, #g, 2 do info[g[i]] = g[i + 1] end
    if info['name'] == group then return info end
  end
  return nil
end
local function lag_of(stream, info, bound)  -- unread entries, given the group's `group_of`
  if info == false then return 0 end  -- no stream: nothing waits
  if info == nil then return redis.call('XLEN', stream) end  -- no consumer ever joined
  if type(info['lag']) == 'number' then return info['lag'] end
  -- lag unknown after deletions: count what lies past the last delivered id
  local after = '(' .. info['last-delivered-id']
  return #redis.call('XRANGE', stream, after, '+', 'COUNT', bound)
end
local function unread(stream, group, bound)  -- entries of `stream` no consumer has read yet
  return lag_of(stream, group_of(stream, group), bound)
end
local function waiting(stream, group, bound)  -- unread entries and those in the wait set
  return unread(stream, group, bound) + redis.call('HLEN', stream .. ':wait:m')
end
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
-- Queue `payload` on `stream` in order; the new entry id, or 'in-wait-set' (it waits in the wait
-- set). `cost`: the request's tokens over its tenant's weight; `age_ms`: its age bound.
local function ordered_add(stream, group, payload, token, priority, tenant, cost, age_ms)
  local w = stream .. ':wait'
  local v = tonumber(redis.call('GET', w .. ':v') or '0')
  local start = math.max(v, tonumber(redis.call('HGET', w .. ':fin', tenant) or '0'))
  redis.call('HSET', w .. ':fin', tenant, tostring(start + cost))
  if redis.call('EXISTS', w .. ':m') == 0 and unread(stream, group, 1) == 0 then
    if start > v then redis.call('SET', w .. ':v', tostring(start)) end
    return redis.call('XADD', stream, '*', ${MESSAGE_FIELD}, payload, 'p', priority, 't', tenant)
  end
  local band = tostring(priority)
  redis.call('HSET', w .. ':m', token, payload)
  redis.call('HSET', w .. ':info', token, band)
  redis.call('HSET', w .. ':tenant', token, tenant)
  redis.call('ZADD', w .. ':bands', priority, band)
  redis.call('ZADD', w .. ':b:' .. band, start, token)
  redis.call('ZADD', w .. ':age', now_ms() + age_ms, token)
  return 'in-wait-set'
end
-- Queue on `stream`: in order when `order` (ARGV items: priority, tenant, cost, age ms) is
-- given, else at the stream's end.
local function queue_on(stream, group, payload, token, order)
  if order then
    return ordered_add(stream, group, payload, token, tonumber(order[1]), order[2],
      tonumber(order[3]), tonumber(order[4]))
  end
  return redis.call('XADD', stream, '*', ${MESSAGE_FIELD}, payload)
end
