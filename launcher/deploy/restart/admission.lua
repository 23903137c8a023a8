-- Rendered beside the front's config by llama-launcher (launcher/deploy/restart/admission.py
-- says why and how): admission against llama-server's shared KV pool, inside HAProxy.
--
-- A generation is admitted only when its worst case fits what the pool has left: the cells
-- reserved by the requests admitted before it and still running, plus its own prompt (counted
-- by the server's own template and tokenizer: POST /apply-template, then /tokenize) and what it
-- may generate (max_tokens, else up to its slot's window), at most one slot's window. Idle
-- slots' cached cells count as free: llama-server purges them when a batch needs room.
-- A request that does not fit waits here, first come first served, at most `queue` of them
-- and `wait` seconds each; past either: 503 with Retry-After. A prompt no slot can hold gets
-- the server's own 400 at once. A client that leaves is taken out of the queue (option
-- abortonclose ends this action; the filter's end_analyze removes its ticket).
-- A reservation ends with its stream (the filter's end_analyze).
-- Without a pool (0: a split pool, or none announced yet) every request is admitted.

local cfg = {
  pool = tonumber(os.getenv("LLAMA_ADMIT_POOL") or "0") or 0,
  slot = tonumber(os.getenv("LLAMA_ADMIT_SLOT") or "0") or 0,
  queue = tonumber(os.getenv("LLAMA_ADMIT_QUEUE") or "64") or 64,
  wait = tonumber(os.getenv("LLAMA_ADMIT_WAIT") or "120") or 120,
  server = os.getenv("LLAMA_ADMIT_SERVER") or "",
  poll_ms = 10,
  slots_ms = 200,
}

-- what `llama admission` shows (launcher.deploy.restart.admission.Ledger parses it)
local st = {
  admitted = 0, waited = 0, refused_queue = 0, refused_wait = 0, refused_large = 0,
  left = 0, counted = 0, bounded = 0, released = 0, pool_unread = 0,
  refused_server = 0,
  prompt_tokens = 0,
}
local WAIT_BOUNDS = { 0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300 }
local waits = { counts = {}, sum = 0, n = 0 }
for i = 1, #WAIT_BOUNDS do waits.counts[i] = 0 end

local queue = {}     -- tickets waiting, oldest first
local held = {}      -- ticket -> cells reserved by an admitted request
local reserved = 0
local next_ticket = 0
-- the server's busy slots beyond the generations admitted here (a client that went around
-- the front, the gate's and the sampler's probes), each bounded by a slot's window; read
-- from /slots every slots_ms. A lower bound: an admitted generation that waits for a slot
-- hides one taken around the front. Unreadable: 0, and said (pool_read)
local unseen = 0
local pool_read = false
local last_auth = nil -- the Authorization of the last request that counted: /slots needs a key

local function now()
  local t = core.now()
  return t.sec + t.usec / 1e6
end

local function running()
  local n = 0
  for _ in pairs(held) do n = n + 1 end
  return n
end

local function taken()
  return reserved + unseen * math.min(cfg.slot, cfg.pool)
end

core.register_task(function()
  while true do
    if cfg.pool > 0 and cfg.server ~= "" then
      local headers = {}
      if last_auth then headers["authorization"] = { last_auth } end
      local hc = core.httpclient()
      local ok, r = pcall(hc.get, hc, { url = "http://" .. cfg.server .. "/slots",
                                        headers = headers, timeout = 2000 })
      if ok and r and r.status == 200 and r.body and r.body:sub(1, 1) == "[" then
        local _, busy = r.body:gsub('"is_processing":%s*true', "")
        unseen = math.max(0, busy - running())
        pool_read = true
      else
        unseen, pool_read = 0, false
        st.pool_unread = st.pool_unread + 1
      end
    else
      unseen, pool_read = 0, false
    end
    core.msleep(cfg.slots_ms)
  end
end)

local function unqueue(ticket)
  for i, t in ipairs(queue) do
    if t == ticket then
      table.remove(queue, i)
      return true
    end
  end
  return false
end

local function observe(seconds)
  waits.sum = waits.sum + seconds
  waits.n = waits.n + 1
  for i, bound in ipairs(WAIT_BOUNDS) do
    if seconds <= bound then waits.counts[i] = waits.counts[i] + 1 end
  end
end

local function json_string(s)
  return '"' .. s:gsub('[%c"\\]', function(c)
    if c == '"' then return '\\"' elseif c == '\\' then return '\\\\' end
    return string.format('\\u%04x', c:byte())
  end) .. '"'
end

local function reply(txn, status, reason, body, retry)
  local headers = { ["content-type"] = { "application/json; charset=utf-8" } }
  if retry then headers["retry-after"] = { tostring(retry) } end
  txn:done(txn:reply({ status = status, reason = reason, headers = headers, body = body }))
end

-- a count's answer: the body of a 200; a refusal of the request itself (400, 401, 403, 404:
-- malformed, no or a wrong key), which the client gets at once; or nil (no count)
local function post(hc, url, headers, body)
  local ok, r = pcall(hc.post, hc, { url = url, headers = headers, body = body, timeout = 10000 })
  if not ok or not r then return nil end
  if r.status == 200 and r.body then return r.body end
  if r.status == 400 or r.status == 401 or r.status == 403 then
    error({ refused = r.status, body = r.body or "", headers = r.headers })
  end
  return nil
end

local function tokens_of(hc, base, headers, tokenize)
  local answer = post(hc, base .. "/tokenize", headers, tokenize)
  local tokens = answer and answer:match('^{"tokens":%[(.-)%]')
  if tokens == nil then return nil end
  if tokens == "" then return 0 end
  local _, commas = tokens:gsub(",", ",")
  return commas + 1
end

local function input_tokens(hc, url, headers, body)
  local answer = post(hc, url, headers, body)
  return answer and tonumber(answer:match('"input_tokens":%s*(%d+)'))
end

-- media the tokenizer does not count (a projector reads it into cells of its own): bounded
local MEDIA = { '"image_url"', '"input_audio"', '"input_image"', '"type":"image"', '"type": "image"' }

-- the prompt's tokens as the server will count them, or nil (then the slot's window bounds
-- it): a chat through the server's template and tokenizer, Anthropic's messages and the
-- Responses API through their own counts, a completion's string prompt through the
-- tokenizer; anything else is bounded. Raises {refused = status} when the server refuses
-- the request itself.
local function count(txn, body)
  if cfg.server == "" then return nil end
  for _, media in ipairs(MEDIA) do
    if body:find(media, 1, true) then return nil end
  end
  local headers = { ["content-type"] = { "application/json" } }
  for _, name in ipairs({ "authorization", "x-api-key" }) do
    local value = txn.f:req_hdr(name)
    if value then headers[name] = { value } end
  end
  local hc = core.httpclient()
  local base = "http://" .. cfg.server
  local path = txn.f:path() or ""
  if path:match("/messages$") then
    return input_tokens(hc, base .. "/v1/messages/count_tokens", headers, body)
  end
  if path:match("/responses$") then
    return input_tokens(hc, base .. "/v1/responses/input_tokens", headers, body)
  end
  if path:match("chat/completions$") then
    local answer = post(hc, base .. "/apply-template", headers, body)
    if answer == nil then return nil end
    local tokenize, n = answer:gsub('^{"prompt":', '{"add_special":true,"parse_special":true,"content":', 1)
    if n ~= 1 then return nil end
    return tokens_of(hc, base, headers, tokenize)
  end
  if path:match("/completions?$") then
    local prompt = txn.sc:json_query(body, "$.prompt")
    -- a prompt of tokens or pieces (an array: json_query gives ""; an object) is bounded
    if type(prompt) ~= "string" or prompt == "" or prompt:match("^%s*[%[{]") then return nil end
    -- a body of the front's own making: a refusal of it is no answer to the client's request
    -- (json_query gives \u00XX as a raw byte, which the server may take for bad UTF-8)
    local ok, n = pcall(tokens_of, hc, base, headers,
      '{"add_special":true,"parse_special":true,"content":' .. json_string(prompt) .. '}')
    return ok and n or nil
  end
  return nil
end

local function bound_of(txn, body)
  for _, key in ipairs({ "$.max_tokens", "$.max_completion_tokens", "$.max_output_tokens", "$.n_predict" }) do
    local v = tonumber(txn.sc:json_query(body, key, "int"))
    if v ~= nil and v > 0 then return math.floor(v) end
  end
  return nil
end

local function unavailable(txn, why, counter, retry)
  st[counter] = st[counter] + 1
  reply(txn, 503, "Service Unavailable", string.format(
    '{"error":{"code":503,"message":%s,"type":"unavailable_error"}}', json_string(why)),
    retry or math.max(1, math.floor(cfg.wait / 4)))
end

local function queue_full(txn)
  if #queue < cfg.queue then return false end
  unavailable(txn, string.format("the front's admission queue is full (%d requests wait for room in the KV pool); try again later", cfg.queue), "refused_queue")
  return true
end

core.register_action("llama_admit", { "http-req" }, function(txn)
  local t0 = now()  -- a wait counts from the request's arrival, its count included
  if cfg.pool <= 0 or cfg.slot <= 0 then return end
  if queue_full(txn) then return end  -- before the count: an overload costs the server nothing
  local body = txn.f:req_body() or ""
  -- only a whole body is counted: one larger than the buffer, or sent in chunks (whose end
  -- wait-for-body does not tell from a pause), is bounded by the window
  local length = tonumber(txn.f:req_hdr("content-length") or "")
  local prompt = nil
  if length ~= nil and #body >= length then
    local ok, got = pcall(count, txn, body)
    if not ok and type(got) == "table" and got.refused then
      st.refused_server = st.refused_server + 1
      local reasons = { [400] = "Bad Request", [401] = "Unauthorized", [403] = "Forbidden" }
      reply(txn, got.refused, reasons[got.refused], got.body)
      return
    end
    if ok then prompt = got end
  end
  local slot = math.min(cfg.slot, cfg.pool)
  if prompt == nil then
    st.bounded = st.bounded + 1
  else
    -- a key that counted is one the server takes: /slots is read with it
    last_auth = txn.f:req_hdr("authorization") or last_auth
    st.counted = st.counted + 1
    st.prompt_tokens = st.prompt_tokens + prompt
    if prompt >= slot then
      st.refused_large = st.refused_large + 1
      reply(txn, 400, "Bad Request", string.format(
        '{"error":{"code":400,"message":"request (%d tokens) exceeds the available context size (%d tokens), try increasing it","type":"exceed_context_size_error","n_prompt_tokens":%d,"n_ctx":%d}}',
        prompt, slot, prompt, slot))
      return
    end
  end
  local gen = bound_of(txn, body)
  local need = slot
  if prompt ~= nil and gen ~= nil then need = math.min(slot, prompt + gen) end
  if queue_full(txn) then return end
  next_ticket = next_ticket + 1
  local ticket = next_ticket
  queue[#queue + 1] = ticket
  txn:set_var("txn.llama_ticket", ticket)
  local waited = false
  while not (queue[1] == ticket and taken() + need <= cfg.pool) do
    if now() - t0 > cfg.wait then
      unqueue(ticket)
      unavailable(txn, string.format("no room in the KV pool for this request's %d cells within %g s; try again later", need, cfg.wait), "refused_wait")
      return
    end
    local stopping = txn.f:stopping()  -- a boolean fetch comes to Lua as a number
    if stopping == true or stopping == 1 then
      -- this HAProxy is stopping (a restart): the client asks the next one at once, rather
      -- than wait here until systemd's stop timeout cuts it
      unqueue(ticket)
      unavailable(txn, "the front is restarting; try again", "refused_wait", 1)
      return
    end
    waited = true
    -- the head of the queue looks often; the others wait their turn
    core.msleep(queue[1] == ticket and cfg.poll_ms or 5 * cfg.poll_ms)
  end
  table.remove(queue, 1)
  reserved = reserved + need
  held[ticket] = need
  txn:set_var("txn.llama_admitted", ticket)
  st.admitted = st.admitted + 1
  if waited then st.waited = st.waited + 1 end
  observe(now() - t0)
end, 0)

-- ends a stream's ticket: out of the queue, or its reservation released (end_analyze only,
-- the least of HAProxy 2.6's filter API: a finished stream and one cut short are not told
-- apart; a cut one's slot is stopped by llama-server at its next token)
Release = {}
Release.id = "llama-release"
Release.flags = filter.FLT_CFG_FL_HTX
Release.__index = Release

function Release:new()
  return setmetatable({}, Release)
end

-- called at the stream's end for one channel or both: the first call does the work, the
-- second finds nothing left to do
function Release:end_analyze(txn, chn)
  local waiting = txn:get_var("txn.llama_ticket")
  if waiting ~= nil and txn:get_var("txn.llama_admitted") == nil and unqueue(waiting) then
    st.left = st.left + 1
  end
  local ticket = txn:get_var("txn.llama_admitted")
  local cells = ticket and held[ticket]
  if cells == nil then return end
  held[ticket] = nil
  st.released = st.released + 1
  reserved = reserved - cells
end

core.register_filter("llama_release", Release, function(f, args)
  return f
end)

local function show(applet)
  local lines = {
    "pool " .. cfg.pool, "slot " .. cfg.slot, "queue_limit " .. cfg.queue,
    "wait_limit " .. cfg.wait, "server " .. (cfg.server ~= "" and cfg.server or "-"),
    "reserved " .. reserved, "running " .. running(), "waiting " .. #queue,
    "unseen " .. unseen, "pool_read " .. (pool_read and 1 or 0),
  }
  for k, v in pairs(st) do lines[#lines + 1] = k .. " " .. v end
  for i, bound in ipairs(WAIT_BOUNDS) do
    lines[#lines + 1] = "wait_le_" .. bound .. " " .. waits.counts[i]
  end
  lines[#lines + 1] = "wait_count " .. waits.n
  lines[#lines + 1] = string.format("wait_sum %.6f", waits.sum)
  applet:send(table.concat(lines, "\n") .. "\n")
end

-- `llama admission`: the ledger; `llama admission set POOL SLOT HOST:PORT`: a deploy's pool
core.register_cli({ "llama", "admission" }, "llama admission [set POOL SLOT HOST:PORT] : the KV pool's admission",
  function(applet, a, b, verb, pool, slot, server)
    if verb == "set" then
      local p, s = tonumber(pool), tonumber(slot)
      if p == nil or s == nil or server == nil then
        applet:send("usage: llama admission set POOL SLOT HOST:PORT\n")
        return
      end
      cfg.pool, cfg.slot, cfg.server = p, s, server
      applet:send("set\n")
      return
    end
    show(applet)
  end)
