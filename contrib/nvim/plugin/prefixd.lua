-- Commands of the prefixd plugin; the module loads on first use. See docs/editors.md, "Neovim", in prefixd's repository.
if vim.g.loaded_prefixd then
  return
end
vim.g.loaded_prefixd = true

local function prefixd()
  return require('prefixd')
end

-- :PrefixdComplete            complete after the cursor
-- :'<,'>PrefixdComplete [how] rewrite the selected lines (optionally: how)
vim.api.nvim_create_user_command('PrefixdComplete', function(cmd)
  prefixd().command(cmd)
end, { range = true, nargs = '*', desc = 'prefixd: complete after the cursor, or rewrite the range' })

vim.api.nvim_create_user_command('PrefixdWarm', function()
  local reply = prefixd().warm()
  if reply then
    vim.notify(prefixd().format_cache(reply), vim.log.levels.INFO, { title = 'prefixd' })
  end
end, { desc = 'prefixd: prefill the text before the cursor into the cache' })

vim.api.nvim_create_user_command('PrefixdPin', function(cmd)
  prefixd().pin({ project_only = cmd.bang })
end, { bang = true, desc = "prefixd: keep this file's system message (with !: the system prompt only) cached" })

vim.api.nvim_create_user_command('PrefixdCancel', function()
  prefixd().cancel()
end, { desc = 'prefixd: stop the answer being written' })
