-- prefixd for Neovim 0.7+: complete after the cursor or rewrite a selection with a local
-- prefixd daemon, streaming the answer into the buffer and showing what the prefix cache did.
-- The transport lives in prefixd.rpc; this module builds requests and edits buffers.

local M = {}
local api = vim.api
local rpc = require('prefixd.rpc')
local is_nil = rpc.is_nil
local ns = api.nvim_create_namespace('prefixd')

M.config = {
  socket = nil, -- default: $PREFIXD_SOCKET, else the daemon's default path
  model = nil, -- default: the daemon's default model
  max_tokens = 128,
  temperature = 0,
  stop = nil, -- e.g. { '\n\n' } for one-paragraph completions
  stream = true,
  context_lines = 400, -- lines of the buffer sent as context
  system_prompt = 'You are a careful programming assistant inside a text editor. '
    .. 'When asked to rewrite lines, reply with the replacement lines only, without explanations.',
  notify = true, -- show the cache figures after every answer
  warm_on_idle = false, -- cache.warm the text before the cursor on CursorHold / CursorHoldI
}

M.last = nil -- the last final reply: { text, finish_reason, usage, cache, timings, ... }
local running = nil -- the streamed request in flight, if any

local function notify(msg, level)
  vim.notify(msg, level or vim.log.levels.INFO, { title = 'prefixd' })
end

--- A one-line summary of a reply's cache map and timings.
function M.format_cache(result)
  local c, t = result.cache or {}, result.timings or {}
  local parts = {}
  if c.hit == 'miss' or c.hit == 'off' then
    table.insert(parts, string.format('cache %s (%s)', c.hit, is_nil(c.miss_reason) and '-' or c.miss_reason))
  else
    table.insert(parts, string.format('cache %s hit', tostring(c.hit)))
  end
  table.insert(parts, string.format('reused %d/%d tokens', c.reused_tokens or 0, c.prompt_tokens or 0))
  if not is_nil(c.diverged_at) and c.hit ~= 'exact' then
    local where = 'diverged at token ' .. c.diverged_at
    if not is_nil(c.diverged_message) then
      where = where .. string.format(' (message %d, %s)', c.diverged_message.index, c.diverged_message.role)
    end
    table.insert(parts, where)
  end
  if (tonumber(c.saved_ms_est) or 0) > 0 then
    table.insert(parts, string.format('saved ~%d ms', math.floor(c.saved_ms_est + 0.5)))
  end
  if not is_nil(t.ttft_ms) then
    table.insert(parts, string.format('ttft %d ms', math.floor(t.ttft_ms + 0.5)))
  end
  return 'prefixd: ' .. table.concat(parts, ' · ')
end

local function with_defaults(params)
  params.model = params.model or M.config.model
  return params
end

M.socket_path = rpc.socket_path
M.request = rpc.request
M.request_async = rpc.request_async
M.stream = rpc.stream

-- -- what goes in a request -------------------------------------------------------------------------

local function buffer_name(buf)
  local name = api.nvim_buf_get_name(buf)
  return name ~= '' and vim.fn.fnamemodify(name, ':~:.') or '[No Name]'
end

--- The completion prompt: buffer text up to the insertion point (0-based row, byte col).
function M.completion_prompt(buf, row, col)
  local first = math.max(0, row - M.config.context_lines)
  local lines = api.nvim_buf_get_lines(buf, first, row + 1, false)
  lines[#lines] = lines[#lines]:sub(1, col)
  return table.concat(lines, '\n')
end

--- The system message for a rewrite: the (pinnable) system prompt, then the file as context.
--- It comes first and changes only when the file does, so repeated rewrites reuse it from the cache.
function M.file_system_message(buf)
  local lines = api.nvim_buf_get_lines(buf, 0, M.config.context_lines, false)
  local ft = vim.bo[buf].filetype
  return {
    role = 'system',
    content = M.config.system_prompt .. '\n\nThe file being edited is ' .. buffer_name(buf)
      .. (ft ~= '' and (' (' .. ft .. ')') or '') .. ':\n```\n' .. table.concat(lines, '\n') .. '\n```',
  }
end

function M.rewrite_messages(buf, line1, line2, instruction)
  local selection = table.concat(api.nvim_buf_get_lines(buf, line1 - 1, line2, false), '\n')
  local ask = string.format('Rewrite lines %d-%d', line1, line2)
  if instruction and instruction ~= '' then
    ask = ask .. ' as follows: ' .. instruction
  end
  return {
    M.file_system_message(buf),
    { role = 'user', content = ask .. '\n```\n' .. selection .. '\n```' },
  }
end

local function generate_params(extra)
  return with_defaults(vim.tbl_extend('force', {
    max_tokens = M.config.max_tokens,
    temperature = M.config.temperature,
    stop = M.config.stop,
  }, extra))
end

-- -- writing into the buffer ---------------------------------------------------------------------------

-- Inserts streamed text at an extmark that moves along with it, so edits elsewhere are harmless.
local function make_writer(buf, row, col)
  local mark = api.nvim_buf_set_extmark(buf, ns, row, col, { right_gravity = true })
  local start = api.nvim_buf_set_extmark(buf, ns, row, col, { right_gravity = false })
  local writer = { num_pieces = 0 }

  function writer.write(text)
    if not api.nvim_buf_is_valid(buf) then
      return
    end
    local pos = api.nvim_buf_get_extmark_by_id(buf, ns, mark, {})
    if writer.num_pieces > 0 then
      pcall(vim.cmd, 'silent! undojoin') -- one answer, one undo step
    end
    api.nvim_buf_set_text(buf, pos[1], pos[2], pos[1], pos[2], vim.split(text, '\n', { plain = true }))
    writer.num_pieces = writer.num_pieces + 1
  end

  --- Replace everything written so far (e.g. to drop a code fence around the answer).
  function writer.replace(text)
    local s = api.nvim_buf_get_extmark_by_id(buf, ns, start, {})
    local e = api.nvim_buf_get_extmark_by_id(buf, ns, mark, {})
    pcall(vim.cmd, 'silent! undojoin')
    api.nvim_buf_set_text(buf, s[1], s[2], e[1], e[2], vim.split(text, '\n', { plain = true }))
  end

  function writer.close()
    if api.nvim_buf_is_valid(buf) then
      api.nvim_buf_del_extmark(buf, ns, mark)
      api.nvim_buf_del_extmark(buf, ns, start)
    end
  end

  return writer
end

local function unfence(text)
  local inner = text:match('^%s*```[^\n]*\n(.-)\n?```%s*$')
  return inner
end

local function run(params, writer, opts)
  local function done(err, result)
    running = nil
    if err then
      writer.close()
      if err ~= 'cancelled' then
        notify('prefixd: ' .. err, vim.log.levels.ERROR)
      end
      if opts.on_done then
        opts.on_done(err, nil)
      end
      return
    end
    if opts.unfence then
      local inner = unfence(result.text)
      if inner then
        writer.replace(inner)
      end
    end
    writer.close()
    M.last = result
    if M.config.notify then
      notify(M.format_cache(result))
    end
    if opts.on_done then
      opts.on_done(nil, result)
    end
  end

  if M.config.stream then
    running = M.stream(params, writer.write, done)
  else
    local ok, result = pcall(M.request, 'generate', params)
    if ok then
      writer.write(result.text)
      done(nil, result)
    else
      done(tostring(result):gsub('^prefixd: ', ''), nil)
    end
  end
end

-- -- commands -----------------------------------------------------------------------------------

--- Complete after the cursor (normal mode: after the character under it, like `a`).
function M.complete(opts)
  opts = opts or {}
  local buf = api.nvim_get_current_buf()
  local cursor = api.nvim_win_get_cursor(0)
  local row = cursor[1] - 1
  local line = api.nvim_buf_get_lines(buf, row, row + 1, false)[1]
  local col = opts.col or math.min(#line, cursor[2] + (#line > 0 and 1 or 0))
  local params = generate_params({ prompt = M.completion_prompt(buf, row, col) })
  run(params, make_writer(buf, row, col), opts)
end

--- Rewrite lines line1..line2 (1-based, inclusive) following an optional instruction.
function M.rewrite(line1, line2, instruction, opts)
  opts = opts or {}
  local buf = api.nvim_get_current_buf()
  local params = generate_params({ messages = M.rewrite_messages(buf, line1, line2, instruction) })
  api.nvim_buf_set_lines(buf, line1 - 1, line2, false, { '' })
  run(params, make_writer(buf, line1 - 1, 0), vim.tbl_extend('force', { unfence = true }, opts))
end

local warming = nil -- the asynchronous cache.warm in flight, if any

--- Prefill what the next completion at the cursor will send, so that it is a warm hit. Blocks
--- and returns the reply ({model, cache, timings}), or with opts.async returns at once and
--- calls opts.on_done(err, result); a newer asynchronous warm cancels an older one.
function M.warm(opts)
  opts = opts or {}
  local buf = api.nvim_get_current_buf()
  local cursor = api.nvim_win_get_cursor(0)
  local prompt = M.completion_prompt(buf, cursor[1] - 1, opts.col or (cursor[2] + 1))
  if prompt == '' then
    return nil
  end
  local params = with_defaults({ prompt = prompt })
  if not opts.async then
    return M.request('cache.warm', params)
  end
  if warming then
    warming.cancel()
  end
  local handle
  handle = M.request_async('cache.warm', params, nil, function(err, result)
    if warming == handle then
      warming = nil
    end
    if opts.on_done then
      opts.on_done(err, result)
    end
  end)
  warming = handle
  return handle
end

--- Warm the system message of rewrites in this buffer (file context included) and keep it resident.
function M.pin(opts)
  opts = opts or {}
  local params = with_defaults({
    messages = opts.project_only and { { role = 'system', content = M.config.system_prompt } }
      or { M.file_system_message(api.nvim_get_current_buf()) },
    add_generation_prompt = false,
  })
  local warmed = M.request('cache.warm', params)
  local pinned = M.request('cache.pin', params)
  if M.config.notify then
    notify(string.format('prefixd: pinned %d tokens (%d KiB)', pinned.pinned_tokens, math.floor(pinned.pinned_bytes / 1024)))
  end
  return warmed, pinned
end

--- Whether an asynchronous cache.warm (warm_on_idle) is still running.
function M.warm_in_flight()
  return warming ~= nil
end

function M.cancel()
  if running then
    running.cancel()
  end
end

function M.command(cmd)
  if cmd.range and cmd.range > 0 then
    M.rewrite(cmd.line1, cmd.line2, cmd.args)
  else
    M.complete()
  end
end

local last_warmed = nil
local function warm_on_idle()
  if running or vim.bo.buftype ~= '' then
    return
  end
  local cursor = api.nvim_win_get_cursor(0)
  local key = api.nvim_get_current_buf() .. ':' .. api.nvim_buf_get_changedtick(0) .. ':' .. cursor[1] .. ':' .. cursor[2]
  if key == last_warmed then
    return
  end
  last_warmed = key
  -- In insert mode the cursor column is the insertion point.
  local col = vim.fn.mode():sub(1, 1) == 'i' and cursor[2] or nil
  M.warm({ col = col, async = true })
end

function M.setup(opts)
  M.config = vim.tbl_deep_extend('force', M.config, opts or {})
  rpc.socket = M.config.socket
  local group = api.nvim_create_augroup('prefixd', { clear = true })
  if M.config.warm_on_idle then
    api.nvim_create_autocmd({ 'CursorHold', 'CursorHoldI' }, { group = group, callback = warm_on_idle })
  end
end

return M
