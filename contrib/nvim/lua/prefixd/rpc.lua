-- The transport of the prefixd plugin: msgpack-RPC to the daemon's Unix socket, Neovim 0.7+.
--
-- Two ways, both built into Neovim:
--   * requests that return one answer (cache.warm, cache.pin, a non-streamed generate) use
--     sockconnect(..., {rpc = true}) + rpcrequest(): simple, but they block the editor;
--   * request_async() and streamed generates use a plain vim.loop pipe with vim.mpack, since
--     Neovim takes notifications on an rpc channel (the daemon's generate.chunk) for calls of
--     its own API. Each such request has a connection of its own: closing it cancels the request.

local R = {}
local uv = vim.uv or vim.loop -- vim.uv from Neovim 0.10
local NIL = vim.NIL

R.socket = nil -- set by setup(); nil means the daemon's default path
local rpc_channel = nil

function R.is_nil(v)
  return v == nil or v == NIL
end

local function default_socket()
  local env = vim.env.PREFIXD_SOCKET
  if env and env ~= '' then
    return vim.fn.expand(env)
  end
  if vim.fn.has('mac') == 1 then
    return vim.fn.expand('~/Library/Caches/prefixd/prefixd.sock')
  end
  local runtime = vim.env.XDG_RUNTIME_DIR
  if runtime and runtime ~= '' and vim.fn.isdirectory(runtime) == 1 then
    return runtime .. '/prefixd/prefixd.sock'
  end
  local tmp = (vim.env.TMPDIR and vim.env.TMPDIR ~= '') and vim.env.TMPDIR:gsub('/$', '') or '/tmp'
  return tmp .. '/prefixd-' .. uv.getuid() .. '/prefixd.sock'
end

function R.socket_path()
  return R.socket and vim.fn.expand(R.socket) or default_socket()
end

local function error_text(err)
  if type(err) == 'table' then
    return string.format('%s (code %s)', tostring(err.message), tostring(err.code))
  end
  return tostring(err)
end

-- -- blocking requests over Neovim's own msgpack-RPC ---------------------------------------------

local function connect_rpc()
  local path = R.socket_path()
  local ok, ch = pcall(vim.fn.sockconnect, 'pipe', path, { rpc = true })
  if not ok or ch == 0 then
    error(string.format('prefixd: cannot connect to %s (is `prefixd serve` running?)', path), 0)
  end
  return ch
end

--- Call a daemon method and return its result map; raises a Lua error on failure.
function R.request(method, params)
  for attempt = 1, 2 do
    rpc_channel = rpc_channel or connect_rpc()
    local ok, result = pcall(vim.rpcrequest, rpc_channel, method, params or vim.empty_dict())
    if ok then
      return result
    end
    pcall(vim.fn.chanclose, rpc_channel)
    rpc_channel = nil -- the daemon may have restarted: reconnect once
    if attempt == 2 or not tostring(result):find('channel') then
      error('prefixd: ' .. method .. ' failed: ' .. tostring(result), 0)
    end
  end
end

-- -- requests that do not block the editor: a plain pipe -----------------------------------------

--- Send one request on a connection of its own without blocking. on_text(text) gets the pieces of a
--- streamed generate, on_done(err, result) the end; both run on the main loop. Returns a handle
--- with cancel() (closing the connection makes the daemon cancel the request).
function R.request_async(method, params, on_text, on_done)
  local pipe = uv.new_pipe(false)
  local unpacker = vim.mpack.Unpacker()
  local msgid, finished = 1, false
  local handle = {}

  local function finish(err, result)
    if finished then
      return
    end
    finished = true
    if not pipe:is_closing() then
      pipe:read_stop()
      pipe:close()
    end
    vim.schedule(function()
      on_done(err, result)
    end)
  end

  local function on_message(msg)
    if msg[1] == 2 and msg[2] == 'generate.chunk' then
      local chunk = msg[3][1]
      if chunk.id == msgid and chunk.text ~= '' and on_text then
        vim.schedule(function()
          on_text(chunk.text)
        end)
      end
    elseif msg[1] == 1 and msg[2] == msgid then
      if R.is_nil(msg[3]) then
        finish(nil, msg[4])
      else
        finish(error_text(msg[3]))
      end
    end
  end

  local path = R.socket_path()
  pipe:connect(path, function(err)
    if err then
      return finish(string.format('cannot connect to %s: %s', path, err))
    end
    pipe:write(vim.mpack.encode({ 0, msgid, method, { params } }))
    pipe:read_start(function(read_err, data)
      if read_err or not data then
        return finish(read_err or 'the daemon closed the connection')
      end
      local pos = 1
      while pos <= #data and not finished do
        local msg
        msg, pos = unpacker(data, pos)
        if msg == nil then
          break -- a partial message: the unpacker keeps it for the next read
        end
        on_message(msg)
      end
    end)
  end)

  function handle.cancel()
    finish('cancelled')
  end
  return handle
end

--- A streamed generate: see request_async.
function R.stream(params, on_text, on_done)
  params.stream = true
  return R.request_async('generate', params, on_text, on_done)
end

return R
