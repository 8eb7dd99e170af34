/* runlm chat page: talks to this server's own OpenAI endpoints (/props, /v1/chat/completions with SSE).
 *
 * Conversations live in localStorage; the API key (only when the server asks for one with a 401) lives in
 * sessionStorage and travels only in the Authorization header. Model output is rendered by markdown.js,
 * which builds DOM nodes from text and never uses innerHTML.
 */
(function () {
  'use strict';

  const STORE_KEY = 'runlm.chat.v1';
  const API_KEY = 'runlm.apiKey';
  const DEFAULT_SETTINGS = { system: '', temperature: 0.7, top_p: 0.95, max_tokens: null, seed: null, tools: '' };
  const MAX_IMAGE_SIDE = 1024;
  const md = window.RunlmMarkdown;

  const $ = function (id) { return document.getElementById(id); };
  const ui = {
    app: $('app'), sidebar: $('sidebar'), scrim: $('scrim'), list: $('conversation-list'), newChat: $('new-chat'),
    openSidebar: $('open-sidebar'), closeSidebar: $('close-sidebar'), modelName: $('model-name'),
    modelMeta: $('model-meta'), settingsToggle: $('settings-toggle'), settings: $('settings'),
    system: $('set-system'), temperature: $('set-temperature'), topP: $('set-top-p'), maxTokens: $('set-max-tokens'),
    seed: $('set-seed'), tools: $('set-tools'), toolsError: $('tools-error'), details: $('model-details'), messages: $('messages'), composer: $('composer'),
    prompt: $('prompt'), send: $('send'), stop: $('stop'), attach: $('attach'), fileInput: $('file-input'),
    attachments: $('attachments'), dropHint: $('drop-hint'), keyDialog: $('key-dialog'), keyForm: $('key-form'),
    keyInput: $('api-key'), keyError: $('key-error'), keyCancel: $('key-cancel'), toast: $('toast'),
  };

  const ICONS = {
    edit: 'M4 20h4L19 9l-4-4L4 16v4zM13.5 6.5l4 4',
    trash: 'M4 7h16M10 7V4h4v3M6 7l1 13h10l1-13M10 11v6M14 11v6',
    close: 'M6 6l12 12M18 6L6 18',
  };

  function icon(name) {
    const NS = 'http://www.w3.org/2000/svg';
    const svg = document.createElementNS(NS, 'svg');
    svg.setAttribute('class', 'ic');
    svg.setAttribute('viewBox', '0 0 24 24');
    svg.setAttribute('aria-hidden', 'true');
    svg.setAttribute('focusable', 'false');
    const path = document.createElementNS(NS, 'path');
    path.setAttribute('d', ICONS[name]);
    svg.appendChild(path);
    return svg;
  }

  // -- state ----------------------------------------------------------------------------------------------

  let store = loadStore();
  let props = null;
  let busy = null; // {controller, conv, msg, node}
  let pendingImage = null; // {url, name}
  let stickToBottom = true;

  function uid() {
    return Date.now().toString(36) + Math.random().toString(36).slice(2, 8);
  }

  function cleanSettings(s) {
    const out = Object.assign({}, DEFAULT_SETTINGS);
    if (s && typeof s === 'object') {
      if (typeof s.system === 'string') out.system = s.system;
      if (typeof s.tools === 'string') out.tools = s.tools;
      for (const k of ['temperature', 'top_p', 'max_tokens', 'seed']) {
        if (s[k] === null || (typeof s[k] === 'number' && isFinite(s[k]))) out[k] = s[k];
      }
    }
    return out;
  }

  function loadStore() {
    let data = null;
    try {
      data = JSON.parse(localStorage.getItem(STORE_KEY) || 'null');
    } catch (e) {
      data = null;
    }
    const convs = data && Array.isArray(data.conversations) ? data.conversations : [];
    const conversations = convs.filter(function (c) {
      return c && typeof c.id === 'string' && Array.isArray(c.messages);
    }).map(function (c) {
      return {
        id: c.id, title: typeof c.title === 'string' ? c.title : '', titleEdited: !!c.titleEdited,
        created: c.created || Date.now(), updated: c.updated || Date.now(), settings: cleanSettings(c.settings),
        messages: c.messages.filter(function (m) {
          return m && (m.role === 'user' || m.role === 'assistant' || (m.role === 'tool' &&
            typeof m.toolCallId === 'string' && typeof m.name === 'string')) && typeof m.content === 'string';
        }).map(function (m) {
          if (m.toolCalls !== undefined) {
            m.toolCalls = Array.isArray(m.toolCalls) ? m.toolCalls.filter(function (t) {
              return t && ['id', 'name', 'arguments'].every(function (k) { return typeof t[k] === 'string'; });
            }) : [];
          }
          m.images = Array.isArray(m.images) ? m.images.filter(function (u) {
            return typeof u === 'string' && u.startsWith('data:image/');
          }) : [];
          if (m.pending) { // the page went away while this answer streamed
            delete m.pending;
            m.stopped = true;
          }
          return m;
        }),
      };
    });
    const currentId = data && conversations.some(function (c) { return c.id === data.currentId; }) ? data.currentId : null;
    return { conversations: conversations, currentId: currentId, draft: cleanSettings(data && data.draft) };
  }

  function save() {
    const write = function () {
      localStorage.setItem(STORE_KEY, JSON.stringify({
        version: 1, conversations: store.conversations, currentId: store.currentId, draft: store.draft,
      }));
    };
    try {
      write();
    } catch (e) {
      // Over the quota: images are the big part; drop them from the oldest messages first.
      let dropped = false;
      const convs = store.conversations.slice().sort(function (a, b) { return a.updated - b.updated; });
      for (const c of convs) {
        for (const m of c.messages) {
          if (m.images && m.images.length) {
            m.images = [];
            m.imagesDropped = true;
            dropped = true;
            try { write(); toast('Browser storage is full: older images were removed from saved conversations.'); return; } catch (e2) { /* keep going */ }
          }
        }
      }
      if (!dropped) toast('Could not save the conversation: browser storage is full.');
    }
  }

  function current() {
    return store.conversations.find(function (c) { return c.id === store.currentId; }) || null;
  }

  function settingsOf(conv) {
    return conv ? conv.settings : store.draft;
  }

  // -- HTTP: API key and errors -------------------------------------------------------------------------------

  let keyPrompt = null;

  function askForKey(message) {
    if (keyPrompt) return keyPrompt;
    keyPrompt = new Promise(function (resolve, reject) {
      ui.keyError.hidden = !message;
      ui.keyError.textContent = message || '';
      ui.keyInput.value = '';
      const done = function (ok) {
        ui.keyForm.removeEventListener('submit', onSubmit);
        ui.keyCancel.removeEventListener('click', onCancel);
        ui.keyDialog.removeEventListener('cancel', onCancel);
        if (ui.keyDialog.open) ui.keyDialog.close();
        keyPrompt = null;
        if (ok) resolve(); else reject(new Error('An API key is needed to use this server.'));
      };
      const onSubmit = function (ev) {
        ev.preventDefault();
        const key = ui.keyInput.value.trim();
        if (!key) return;
        sessionStorage.setItem(API_KEY, key);
        done(true);
      };
      const onCancel = function (ev) {
        ev.preventDefault();
        done(false);
      };
      ui.keyForm.addEventListener('submit', onSubmit);
      ui.keyCancel.addEventListener('click', onCancel);
      ui.keyDialog.addEventListener('cancel', onCancel);
      ui.keyDialog.showModal();
      ui.keyInput.focus();
    });
    return keyPrompt;
  }

  async function api(path, options) {
    options = options || {};
    for (;;) {
      const headers = new Headers(options.headers || {});
      const key = sessionStorage.getItem(API_KEY);
      if (key) headers.set('Authorization', 'Bearer ' + key);
      const res = await fetch(path, Object.assign({}, options, { headers: headers, cache: 'no-store' }));
      if (res.status !== 401) return res;
      if (key) sessionStorage.removeItem(API_KEY);
      await askForKey(key ? 'The server did not accept that key. Try again.' : '');
      if (options.signal && options.signal.aborted) throw new DOMException('aborted', 'AbortError');
    }
  }

  async function errorText(res) {
    try {
      const body = await res.json();
      if (body && body.error && body.error.message) return body.error.message;
    } catch (e) { /* not JSON */ }
    return 'the server answered ' + res.status + ' ' + res.statusText;
  }

  // -- model info -----------------------------------------------------------------------------------------------

  function formatCtx(n) {
    if (!n) return '';
    return n >= 1024 && n % 1024 === 0 ? (n / 1024) + 'k' : String(n);
  }

  async function loadProps() {
    ui.modelName.textContent = 'connecting…';
    try {
      const res = await api('/props');
      if (!res.ok) throw new Error(await errorText(res));
      props = await res.json();
    } catch (e) {
      props = null;
      ui.modelName.textContent = e.name === 'TypeError' ? 'server unreachable' : 'not connected';
      ui.modelMeta.textContent = '';
      const retry = document.createElement('button');
      retry.type = 'button';
      retry.className = 'link-button';
      retry.textContent = 'Retry';
      retry.setAttribute('aria-label', 'Connect to the server again');
      retry.addEventListener('click', loadProps);
      ui.modelMeta.appendChild(retry);
      toast(e.message);
      return null;
    }
    ui.modelName.textContent = props.model;
    ui.modelName.title = props.file || props.model;
    const bits = [props.family, formatCtx(props.context_length) && formatCtx(props.context_length) + ' context',
      props.quantization].filter(Boolean);
    ui.modelMeta.textContent = bits.join(' · ');
    ui.details.replaceChildren();
    const rows = [['Model', props.model], ['Family', props.family], ['Context', props.context_length + ' tokens'],
      ['Quantization', props.quantization], ['Format', props.format], ['File', props.file],
      ['Slots', props.total_slots], ['Images', props.multimodal ? 'supported' : 'not supported']];
    for (const row of rows) {
      if (row[1] === undefined || row[1] === null) continue;
      const pair = document.createElement('div');
      pair.append(Object.assign(document.createElement('dt'), { textContent: row[0] }),
        Object.assign(document.createElement('dd'), { textContent: String(row[1]) }));
      ui.details.appendChild(pair);
    }
    ui.attach.hidden = !props.multimodal;
    if (!props.multimodal) setPendingImage(null);
    if (props.has_chat_template === false) toast('This model has no chat template: chat requests will fail.');
    return props;
  }

  // -- rendering ------------------------------------------------------------------------------------------------

  function conversationTitle(conv) {
    return conv.title || 'New conversation';
  }

  function renderSidebar() {
    ui.list.replaceChildren();
    const convs = store.conversations.slice().sort(function (a, b) { return b.updated - a.updated; });
    for (const conv of convs) {
      const li = document.createElement('li');
      li.className = 'conv-item';
      li.dataset.id = conv.id;
      const open = document.createElement('button');
      open.type = 'button';
      open.className = 'conv-open';
      open.textContent = conversationTitle(conv);
      open.title = conversationTitle(conv);
      if (conv.id === store.currentId) open.setAttribute('aria-current', 'true');
      open.addEventListener('click', function () { switchTo(conv.id); });
      const rename = document.createElement('button');
      rename.type = 'button';
      rename.className = 'icon small conv-rename';
      rename.appendChild(icon('edit'));
      rename.setAttribute('aria-label', 'Rename conversation: ' + conversationTitle(conv));
      rename.addEventListener('click', function () { startRename(li, conv); });
      const del = document.createElement('button');
      del.type = 'button';
      del.className = 'icon small conv-delete';
      del.appendChild(icon('trash'));
      del.setAttribute('aria-label', 'Delete conversation: ' + conversationTitle(conv));
      del.addEventListener('click', function () { deleteConversation(conv); });
      li.append(open, rename, del);
      ui.list.appendChild(li);
    }
    if (!convs.length) {
      const li = document.createElement('li');
      li.className = 'conv-empty';
      li.textContent = 'No conversations yet.';
      ui.list.appendChild(li);
    }
  }

  function startRename(li, conv) {
    const input = document.createElement('input');
    input.type = 'text';
    input.className = 'conv-title-input';
    input.value = conversationTitle(conv);
    input.setAttribute('aria-label', 'New name for the conversation');
    let finished = false;
    const finish = function (keep) {
      if (finished) return;
      finished = true;
      const title = input.value.trim();
      if (keep && title) {
        conv.title = title.slice(0, 200);
        conv.titleEdited = true;
        save();
      }
      renderSidebar();
      const again = ui.list.querySelector('li[data-id="' + conv.id + '"] .conv-open');
      if (again) again.focus();
    };
    input.addEventListener('keydown', function (ev) {
      if (ev.key === 'Enter') { ev.preventDefault(); finish(true); }
      if (ev.key === 'Escape') { ev.preventDefault(); ev.stopPropagation(); finish(false); }
    });
    input.addEventListener('blur', function () { finish(true); });
    li.replaceChildren(input);
    input.focus();
    input.select();
  }

  function deleteConversation(conv) {
    if (!window.confirm('Delete the conversation "' + conversationTitle(conv) + '"?')) return;
    if (busy && busy.conv === conv) stop();
    store.conversations = store.conversations.filter(function (c) { return c !== conv; });
    if (store.currentId === conv.id) {
      store.currentId = null;
      store.draft = Object.assign({}, conv.settings);
    }
    save();
    renderAll();
    ui.prompt.focus();
  }

  function switchTo(id) {
    store.currentId = id;
    save();
    renderAll();
    closeSidebar();
    ui.prompt.focus();
  }

  function newChat() {
    const conv = current();
    if (conv) store.draft = Object.assign({}, conv.settings);
    store.currentId = null;
    save();
    setPendingImage(null);
    renderAll();
    closeSidebar();
    ui.prompt.value = '';
    autoGrow();
    ui.prompt.focus();
  }

  function renderSettings() {
    const s = settingsOf(current());
    ui.system.value = s.system || '';
    ui.temperature.value = s.temperature === null ? '' : s.temperature;
    ui.topP.value = s.top_p === null ? '' : s.top_p;
    ui.maxTokens.value = s.max_tokens === null ? '' : s.max_tokens;
    ui.seed.value = s.seed === null ? '' : s.seed;
    ui.tools.value = s.tools || '';
    showToolsError(s.tools);
  }

  // The tools a conversation offers the model: a JSON list of OpenAI function tools in the settings, or none.
  function parseTools(text) {
    if (!text || !text.trim()) return { list: null, error: null };
    let value;
    try {
      value = JSON.parse(text);
    } catch (e) {
      return { list: null, error: 'not JSON (' + e.message + ')' };
    }
    if (!Array.isArray(value)) value = [value];
    const list = value.map(function (t) { return t && t.type === 'function' ? t : { type: 'function', function: t }; });
    const bad = list.findIndex(function (t) { return !t.function || typeof t.function.name !== 'string'; });
    if (bad !== -1) return { list: null, error: 'tool ' + (bad + 1) + ' has no function name' };
    return { list: list, error: null };
  }

  function showToolsError(text) {
    const error = parseTools(text).error;
    ui.toolsError.textContent = error ? 'Tools: ' + error : '';
    ui.toolsError.hidden = !error;
  }

  function readSettings() {
    const s = settingsOf(current());
    const num = function (input, lo, hi, integer) {
      if (input.value.trim() === '') return null;
      let v = Number(input.value);
      if (!isFinite(v)) return null;
      if (integer) v = Math.round(v);
      if (lo !== null) v = Math.max(lo, v);
      if (hi !== null) v = Math.min(hi, v);
      return v;
    };
    s.system = ui.system.value;
    s.temperature = num(ui.temperature, 0, 2, false);
    s.top_p = num(ui.topP, 0, 1, false);
    s.max_tokens = num(ui.maxTokens, 1, null, true);
    s.seed = num(ui.seed, null, null, true);
    s.tools = ui.tools.value;
    showToolsError(s.tools);
    save();
  }

  function emptyState() {
    const box = document.createElement('div');
    box.className = 'empty';
    const h = document.createElement('h1');
    h.textContent = props ? 'Chat with ' + props.model : 'runlm chat';
    const p = document.createElement('p');
    p.textContent = 'Everything runs on this machine. Enter sends, Shift+Enter adds a line, Esc stops an answer.';
    box.append(h, p);
    return box;
  }

  function renderConversation(keepScroll) {
    const conv = current();
    const scrollTop = ui.messages.scrollTop;
    ui.messages.replaceChildren();
    if (!conv || !conv.messages.length) {
      ui.messages.appendChild(emptyState());
      return;
    }
    const lastUser = lastIndexOf(conv, 'user');
    const lastAssistant = lastIndexOf(conv, 'assistant');
    conv.messages.forEach(function (m, i) {
      ui.messages.appendChild(renderMessage(conv, m, i, {
        canEdit: !busy && i === lastUser && i >= conv.messages.length - 2,
        canRegenerate: !busy && i === lastAssistant && i === conv.messages.length - 1,
        awaitsResults: !busy && i === lastAssistant && !m.pending && Boolean(m.toolCalls && m.toolCalls.length),
      }));
    });
    if (keepScroll) ui.messages.scrollTop = scrollTop;
    else scrollToBottom(true);
  }

  function lastIndexOf(conv, role) {
    for (let i = conv.messages.length - 1; i >= 0; i--) if (conv.messages[i].role === role) return i;
    return -1;
  }

  function renderMessage(conv, m, index, opts) {
    const article = document.createElement('article');
    article.className = 'msg ' + m.role;
    article.dataset.index = index;
    article.setAttribute('aria-label', m.role === 'user' ? 'You said' : m.role === 'tool' ? 'A tool result'
      : 'The model answered');
    if (m.pending) article.setAttribute('aria-busy', 'true');
    const body = document.createElement('div');
    body.className = 'body';
    if (m.role === 'user') {
      for (const url of m.images || []) {
        const img = document.createElement('img');
        img.className = 'msg-image';
        img.alt = 'attached image';
        img.src = url;
        body.appendChild(img);
      }
      const text = document.createElement('div');
      text.className = 'user-text';
      text.textContent = m.content;
      body.appendChild(text);
      if (m.imagesDropped) body.appendChild(note('(the attached image was removed to save space)'));
    } else if (m.role === 'tool') {
      const label = document.createElement('div');
      label.className = 'tool-label';
      label.textContent = 'Result of ' + m.name;
      const text = document.createElement('pre');
      text.className = 'tool-result';
      text.textContent = m.content;
      body.append(label, text);
    } else {
      fillAnswer(body, m);
      if (opts.awaitsResults) body.append(...resultForms(conv, m));
    }
    article.appendChild(body);
    if (m.role === 'assistant') {
      if (m.error) {
        const err = document.createElement('p');
        err.className = 'error';
        err.setAttribute('role', 'alert');
        err.textContent = 'Error: ' + m.error;
        article.appendChild(err);
      }
      const stats = document.createElement('div');
      stats.className = 'stats';
      stats.setAttribute('aria-label', 'Generation figures');
      fillStats(stats, m);
      article.appendChild(stats);
    }
    const actions = document.createElement('div');
    actions.className = 'actions';
    if (m.role === 'assistant' && !m.pending && m.content) {
      actions.appendChild(actionButton('Copy', 'Copy the answer', function (ev) { copyText(m.content, ev.currentTarget); }));
    }
    if (opts.canRegenerate) actions.appendChild(actionButton('Regenerate', 'Regenerate the last answer', regenerate));
    if (opts.canEdit) actions.appendChild(actionButton('Edit', 'Edit and resend your last message', function () { startEdit(article, conv, m); }));
    if (actions.childNodes.length) article.appendChild(actions);
    return article;
  }

  // An answer's body: its thinking (when the model gave one) folded away above the Markdown answer.
  function fillAnswer(body, m) {
    const parts = [];
    if (m.reasoning) {
      const shown = body.querySelector('details.thinking');
      const details = document.createElement('details');
      details.className = 'thinking';
      details.open = Boolean(shown && shown.open);
      const summary = document.createElement('summary');
      summary.textContent = m.pending && !m.content ? 'Thinking…' : 'Thoughts';
      const text = document.createElement('div');
      text.className = 'thinking-text';
      text.textContent = m.reasoning;
      details.append(summary, text);
      parts.push(details);
    }
    parts.push(md.render(m.content));
    for (const call of m.toolCalls || []) parts.push(toolCard(call));
    if (m.pending && !m.content && !m.reasoning && !(m.toolCalls && m.toolCalls.length)) parts.push(typing());
    body.replaceChildren(...parts);
  }

  // A tool call as a card: the function's name, its arguments as indented JSON (as they stream: the text so far).
  function toolCard(call) {
    const card = document.createElement('section');
    card.className = 'tool-call';
    card.setAttribute('aria-label', 'Tool call ' + call.name);
    const name = document.createElement('div');
    name.className = 'tool-name';
    name.textContent = call.name + '()';
    const args = document.createElement('pre');
    args.className = 'tool-args';
    try {
      args.textContent = JSON.stringify(JSON.parse(call.arguments), null, 2);
    } catch (e) {
      args.textContent = call.arguments;
    }
    card.append(name, args);
    return card;
  }

  // Under the last answer's tool calls: a field per call still without a result. You are the tool: what you send
  // goes back to the model as that call's result, and once every call has one the model goes on.
  function resultForms(conv, m) {
    const answered = new Set(conv.messages.filter(function (x) { return x.role === 'tool'; })
      .map(function (x) { return x.toolCallId; }));
    return m.toolCalls.filter(function (call) { return !answered.has(call.id); }).map(function (call) {
      const form = document.createElement('form');
      form.className = 'tool-result-form';
      const input = document.createElement('textarea');
      input.rows = 1;
      input.setAttribute('aria-label', 'Result of ' + call.name);
      input.placeholder = 'Result of ' + call.name + ' (what the tool would return)';
      const button = document.createElement('button');
      button.type = 'submit';
      button.textContent = 'Send result';
      form.append(input, button);
      form.addEventListener('submit', function (ev) {
        ev.preventDefault();
        if (busy) return;
        conv.messages.push({ id: uid(), role: 'tool', toolCallId: call.id, name: call.name, content: input.value });
        touch(conv);
        const waiting = m.toolCalls.some(function (c) {
          return !conv.messages.some(function (x) { return x.role === 'tool' && x.toolCallId === c.id; });
        });
        if (waiting) {
          save();
          renderAll();
        } else {
          generate(conv);
        }
      });
      return form;
    });
  }

  function note(text) {
    const p = document.createElement('p');
    p.className = 'note';
    p.textContent = text;
    return p;
  }

  function typing() {
    const span = document.createElement('span');
    span.className = 'typing';
    span.setAttribute('aria-label', 'waiting for the model');
    span.append(document.createElement('i'), document.createElement('i'), document.createElement('i'));
    return span;
  }

  function actionButton(label, aria, onClick) {
    const b = document.createElement('button');
    b.type = 'button';
    b.className = 'action';
    b.textContent = label;
    b.setAttribute('aria-label', aria);
    b.addEventListener('click', onClick);
    return b;
  }

  function fmtMs(ms) {
    return ms >= 1000 ? (ms / 1000).toFixed(2) + ' s' : Math.round(ms) + ' ms';
  }

  function stat(parent, name, text, title) {
    const span = document.createElement('span');
    span.className = 'stat';
    span.dataset.stat = name;
    span.textContent = text;
    if (title) span.title = title;
    parent.appendChild(span);
  }

  function fillStats(node, m) {
    node.replaceChildren();
    const s = m.stats;
    if (!s) return;
    stat(node, 'tokens', s.tokens + (s.tokens === 1 ? ' token' : ' tokens'), s.exact ? 'completion tokens' : 'counted in the browser');
    if (s.ttftMs !== null && s.ttftMs !== undefined) stat(node, 'ttft', 'TTFT ' + fmtMs(s.ttftMs), 'time to first token');
    if (s.tps) stat(node, 'tps', s.tps.toFixed(1) + ' tok/s', 'decode speed');
    if (s.promptTokens !== undefined && s.promptTokens !== null) {
      const hit = s.cachedTokens > 0;
      stat(node, 'cache', hit ? 'cache hit ' + s.cachedTokens + '/' + s.promptTokens : 'no cache hit',
        hit ? s.cachedTokens + ' of ' + s.promptTokens + ' prompt tokens came from the prompt cache'
          : s.promptTokens + ' prompt tokens, none from the prompt cache');
    }
    if (m.stopped) stat(node, 'finish', 'stopped');
    else if (s.finish === 'length') stat(node, 'finish', 'max tokens reached');
  }

  function renderAll(keepScroll) {
    renderSidebar();
    renderSettings();
    renderConversation(keepScroll);
    renderComposer();
  }

  function renderComposer() {
    ui.send.hidden = !!busy;
    ui.stop.hidden = !busy;
    document.body.classList.toggle('busy', !!busy);
  }

  function nearBottom() {
    const el = ui.messages;
    return el.scrollHeight - el.scrollTop - el.clientHeight < 80;
  }

  function scrollToBottom(force) {
    if (force || stickToBottom) ui.messages.scrollTop = ui.messages.scrollHeight;
  }

  // -- editing the last turn --------------------------------------------------------------------------------

  function startEdit(article, conv, m) {
    if (busy) return;
    const box = document.createElement('div');
    box.className = 'edit-box';
    const area = document.createElement('textarea');
    area.value = m.content;
    area.rows = Math.min(10, Math.max(2, m.content.split('\n').length));
    area.setAttribute('aria-label', 'Edit your message');
    const row = document.createElement('div');
    row.className = 'edit-buttons';
    const cancel = actionButton('Cancel', 'Cancel editing', function () { renderConversation(); ui.prompt.focus(); });
    const resend = actionButton('Send', 'Send the edited message', function () { submitEdit(); });
    resend.classList.add('primary');
    row.append(cancel, resend);
    box.append(area, row);
    const submitEdit = function () {
      const text = area.value.trim();
      if (!text || busy) return;
      const at = conv.messages.indexOf(m);
      if (at < 0) return;
      m.content = text;
      conv.messages.length = at + 1; // drop the answer (and anything after) to this turn
      touch(conv);
      generate(conv);
    };
    area.addEventListener('keydown', function (ev) {
      if (ev.key === 'Enter' && !ev.shiftKey && !ev.isComposing) { ev.preventDefault(); submitEdit(); }
      if (ev.key === 'Escape') { ev.preventDefault(); ev.stopPropagation(); renderConversation(); ui.prompt.focus(); }
    });
    article.replaceChildren(box);
    area.focus();
    area.setSelectionRange(area.value.length, area.value.length);
  }

  function regenerate() {
    const conv = current();
    if (!conv || busy) return;
    if (conv.messages.length && conv.messages[conv.messages.length - 1].role === 'assistant') conv.messages.pop();
    if (!conv.messages.length) return;
    generate(conv);
  }

  // -- sending and streaming -----------------------------------------------------------------------------------

  function touch(conv) {
    conv.updated = Date.now();
    if (!conv.titleEdited) {
      const first = conv.messages.find(function (m) { return m.role === 'user'; });
      if (first) {
        const line = first.content.replace(/\s+/g, ' ').trim();
        conv.title = line.length > 48 ? line.slice(0, 47) + '…' : line || 'Image';
      }
    }
  }

  function sendFromComposer() {
    if (busy) return;
    const text = ui.prompt.value.trim();
    if (!text && !pendingImage) return;
    let conv = current();
    if (!conv) {
      conv = { id: uid(), title: '', titleEdited: false, created: Date.now(), updated: Date.now(),
        settings: Object.assign({}, store.draft), messages: [] };
      store.conversations.push(conv);
      store.currentId = conv.id;
    }
    // An answer that failed with nothing in it is not part of the conversation.
    const last = conv.messages[conv.messages.length - 1];
    if (last && last.role === 'assistant' && last.error && !last.content) conv.messages.pop();
    conv.messages.push({ id: uid(), role: 'user', content: text, images: pendingImage ? [pendingImage.url] : [] });
    ui.prompt.value = '';
    autoGrow();
    setPendingImage(null);
    touch(conv);
    generate(conv);
  }

  function requestMessages(conv) {
    const out = [];
    const s = conv.settings;
    if (s.system && s.system.trim()) out.push({ role: 'system', content: s.system });
    // The server takes one image per request: send the latest, and a note in place of earlier ones.
    let lastImage = -1;
    conv.messages.forEach(function (m, i) { if (m.role === 'user' && m.images && m.images.length) lastImage = i; });
    conv.messages.forEach(function (m, i) {
      if (m.role === 'assistant') {
        if (m.pending || (m.error && !m.content && !(m.toolCalls && m.toolCalls.length))) return;
        const turn = { role: 'assistant', content: m.content };
        if (m.toolCalls && m.toolCalls.length) {
          turn.tool_calls = m.toolCalls.map(function (c) {
            return { id: c.id, type: 'function', function: { name: c.name, arguments: c.arguments } };
          });
        }
        out.push(turn);
        return;
      }
      if (m.role === 'tool') {
        out.push({ role: 'tool', tool_call_id: m.toolCallId, content: m.content });
        return;
      }
      if (m.images && m.images.length && i === lastImage) {
        const parts = [{ type: 'image_url', image_url: { url: m.images[m.images.length - 1] } }];
        if (m.content) parts.push({ type: 'text', text: m.content });
        out.push({ role: 'user', content: parts });
      } else if (m.images && m.images.length) {
        out.push({ role: 'user', content: '[an image was shared here]' + (m.content ? '\n' + m.content : '') });
      } else {
        out.push({ role: 'user', content: m.content });
      }
    });
    return out;
  }

  async function generate(conv) {
    if (busy) return;
    const msg = { id: uid(), role: 'assistant', content: '', pending: true, stats: null };
    conv.messages.push(msg);
    const controller = new AbortController();
    busy = { controller: controller, conv: conv, msg: msg };
    save();
    renderAll();
    ui.prompt.focus();

    const s = conv.settings;
    const t0 = performance.now();
    let tFirst = null;
    let pieces = 0;
    let lastSave = t0;
    let frame = 0;
    const live = function () {
      const now = performance.now();
      msg.stats = {
        tokens: pieces, exact: false, ttftMs: tFirst === null ? null : tFirst - t0,
        tps: tFirst !== null && pieces > 1 && now > tFirst ? (pieces - 1) / ((now - tFirst) / 1000) : 0,
      };
    };
    const paint = function () {
      frame = 0;
      const node = ui.messages.querySelector('article.msg.assistant:last-of-type');
      if (!node || store.currentId !== conv.id || conv.messages[conv.messages.length - 1] !== msg) return;
      fillAnswer(node.querySelector('.body'), msg);
      node.setAttribute('aria-busy', msg.pending ? 'true' : 'false');
      fillStats(node.querySelector('.stats'), msg);
      scrollToBottom(false);
    };
    const schedule = function () {
      if (!frame) frame = requestAnimationFrame(paint);
    };
    stickToBottom = true;

    try {
      if (!props) await loadProps();
      if (!props) throw new Error('not connected to the server');
      const body = {
        model: props.model, messages: requestMessages(conv), stream: true, stream_options: { include_usage: true },
      };
      if (s.temperature !== null) body.temperature = s.temperature;
      if (s.top_p !== null) body.top_p = s.top_p;
      if (s.max_tokens !== null) body.max_tokens = s.max_tokens;
      if (s.seed !== null) body.seed = s.seed;
      const tools = parseTools(s.tools);
      if (tools.error) throw new Error('the tools in the settings: ' + tools.error);
      if (tools.list) body.tools = tools.list;
      const res = await api('/v1/chat/completions', {
        method: 'POST', headers: { 'Content-Type': 'application/json', Accept: 'text/event-stream' },
        body: JSON.stringify(body), signal: controller.signal,
      });
      if (!res.ok) throw new Error(await errorText(res));
      const reader = res.body.pipeThrough(new TextDecoderStream()).getReader();
      let buffer = '';
      let finished = false;
      while (!finished) {
        const chunk = await reader.read();
        if (chunk.done) break;
        buffer += chunk.value;
        let cut;
        while ((cut = buffer.search(/\r?\n\r?\n/)) !== -1) {
          const event = buffer.slice(0, cut);
          buffer = buffer.slice(cut).replace(/^\r?\n\r?\n/, '');
          const data = event.split(/\r?\n/).filter(function (l) { return l.startsWith('data:'); })
            .map(function (l) { return l.slice(5).replace(/^ /, ''); }).join('\n');
          if (!data) continue;
          if (data === '[DONE]') { finished = true; break; }
          const obj = JSON.parse(data);
          if (obj.error) throw new Error(obj.error.message || 'the generation failed');
          const choice = obj.choices && obj.choices[0];
          const delta = choice && choice.delta;
          if (delta && (delta.content || delta.reasoning_content || delta.tool_calls)) {
            if (tFirst === null) tFirst = performance.now();
            msg.content += delta.content || '';
            if (delta.reasoning_content) msg.reasoning = (msg.reasoning || '') + delta.reasoning_content;
            for (const piece of delta.tool_calls || []) { // a call's id and name first, then its arguments in pieces
              msg.toolCalls = msg.toolCalls || [];
              const call = msg.toolCalls[piece.index] || (msg.toolCalls[piece.index] = { id: '', name: '', arguments: '' });
              if (piece.id) call.id = piece.id;
              if (piece.function && piece.function.name) call.name = piece.function.name;
              if (piece.function && piece.function.arguments) call.arguments += piece.function.arguments;
            }
            pieces++;
          }
          if (choice && choice.finish_reason) msg.finish = choice.finish_reason;
          if (obj.usage) {
            const u = obj.usage;
            const t = obj.timings || {};
            msg.stats = {
              tokens: u.completion_tokens, exact: true,
              ttftMs: typeof t.ttft_ms === 'number' ? t.ttft_ms : (tFirst === null ? null : tFirst - t0),
              tps: typeof t.predicted_per_second === 'number' ? t.predicted_per_second : 0,
              promptTokens: u.prompt_tokens,
              cachedTokens: (u.prompt_tokens_details && u.prompt_tokens_details.cached_tokens) || 0,
              finish: msg.finish || null,
            };
          } else {
            live();
          }
          schedule();
        }
        if (performance.now() - lastSave > 1000) {
          lastSave = performance.now();
          save();
        }
      }
      if (msg.stats && !msg.stats.exact) live();
    } catch (e) {
      if (e && e.name === 'AbortError') {
        msg.stopped = true;
        live();
      } else {
        msg.error = e && e.message ? e.message : String(e);
        if (e && e.name === 'TypeError' && !msg.content) msg.error = 'cannot reach the server (' + e.message + ')';
      }
    } finally {
      if (frame) cancelAnimationFrame(frame);
      delete msg.pending;
      if (msg.stats && msg.finish && !msg.stats.finish) msg.stats.finish = msg.finish;
      delete msg.finish;
      busy = null;
      touch(conv);
      save();
      renderAll(!stickToBottom); // a reader who scrolled up to read stays where they are
      if (document.activeElement === document.body || !document.activeElement) ui.prompt.focus();
    }
  }

  function stop() {
    if (busy) busy.controller.abort();
  }

  // -- images ----------------------------------------------------------------------------------------------------

  function setPendingImage(img) {
    pendingImage = img;
    ui.attachments.replaceChildren();
    ui.attachments.hidden = !img;
    if (!img) return;
    const fig = document.createElement('figure');
    fig.className = 'attachment';
    const thumb = document.createElement('img');
    thumb.src = img.url;
    thumb.alt = 'image to send: ' + img.name;
    const remove = document.createElement('button');
    remove.type = 'button';
    remove.className = 'icon small';
    remove.appendChild(icon('close'));
    remove.setAttribute('aria-label', 'Remove the attached image');
    remove.addEventListener('click', function () { setPendingImage(null); ui.prompt.focus(); });
    fig.append(thumb, remove);
    ui.attachments.appendChild(fig);
  }

  function readAsDataURL(blob) {
    return new Promise(function (resolve, reject) {
      const r = new FileReader();
      r.onload = function () { resolve(r.result); };
      r.onerror = function () { reject(r.error); };
      r.readAsDataURL(blob);
    });
  }

  async function attachFile(file) {
    if (!props || !props.multimodal) return;
    if (!file || !/^image\//.test(file.type)) {
      toast('Only images can be attached.');
      return;
    }
    try {
      let url;
      let bitmap = null;
      try { bitmap = await createImageBitmap(file); } catch (e) { bitmap = null; }
      if (bitmap && (Math.max(bitmap.width, bitmap.height) > MAX_IMAGE_SIDE || file.size > 1500000)) {
        // Smaller uploads and storage: the vision tower sees under 1024 pixels a side anyway.
        const scale = Math.min(1, MAX_IMAGE_SIDE / Math.max(bitmap.width, bitmap.height));
        const canvas = document.createElement('canvas');
        canvas.width = Math.max(1, Math.round(bitmap.width * scale));
        canvas.height = Math.max(1, Math.round(bitmap.height * scale));
        canvas.getContext('2d').drawImage(bitmap, 0, 0, canvas.width, canvas.height);
        url = canvas.toDataURL('image/jpeg', 0.9);
      } else {
        url = await readAsDataURL(file);
      }
      if (bitmap) bitmap.close();
      setPendingImage({ url: url, name: file.name || 'image' });
      ui.prompt.focus();
    } catch (e) {
      toast('Could not read the image: ' + e.message);
    }
  }

  // -- small helpers -------------------------------------------------------------------------------------------

  let toastTimer = 0;

  function toast(text) {
    ui.toast.textContent = text;
    ui.toast.hidden = false;
    clearTimeout(toastTimer);
    toastTimer = setTimeout(function () { ui.toast.hidden = true; }, 5000);
  }

  async function copyText(text, button) {
    let ok = false;
    try {
      if (navigator.clipboard && window.isSecureContext) {
        await navigator.clipboard.writeText(text);
        ok = true;
      }
    } catch (e) { ok = false; }
    if (!ok) {
      const area = document.createElement('textarea');
      area.value = text;
      area.setAttribute('readonly', '');
      area.className = 'offscreen';
      document.body.appendChild(area);
      area.select();
      try { ok = document.execCommand('copy'); } catch (e) { ok = false; }
      area.remove();
    }
    if (button) {
      const label = button.textContent;
      button.textContent = ok ? 'Copied' : 'Copy failed';
      button.classList.toggle('done', ok);
      setTimeout(function () { button.textContent = label; button.classList.remove('done'); }, 1500);
    }
  }

  function autoGrow() {
    ui.prompt.style.height = 'auto';
    ui.prompt.style.height = Math.min(ui.prompt.scrollHeight + 2, Math.round(window.innerHeight * 0.4)) + 'px';
  }

  function isNarrow() {
    return window.matchMedia('(max-width: 760px)').matches;
  }

  function openSidebar() {
    ui.app.classList.add('sidebar-open');
    ui.scrim.hidden = false;
    ui.openSidebar.setAttribute('aria-expanded', 'true');
    const first = ui.list.querySelector('[aria-current="true"]') || ui.newChat;
    first.focus();
  }

  function closeSidebar() {
    if (!ui.app.classList.contains('sidebar-open')) return;
    ui.app.classList.remove('sidebar-open');
    ui.scrim.hidden = true;
    ui.openSidebar.setAttribute('aria-expanded', 'false');
    if (isNarrow()) ui.openSidebar.focus();
  }

  function toggleSettings(show) {
    const open = show === undefined ? ui.settings.hidden : show;
    ui.settings.hidden = !open;
    ui.settingsToggle.setAttribute('aria-expanded', String(open));
    if (open) ui.system.focus();
  }

  // -- events ----------------------------------------------------------------------------------------------------

  ui.composer.addEventListener('submit', function (ev) {
    ev.preventDefault();
    sendFromComposer();
  });
  ui.prompt.addEventListener('keydown', function (ev) {
    if (ev.key === 'Enter' && !ev.shiftKey && !ev.isComposing && ev.keyCode !== 229) {
      ev.preventDefault();
      sendFromComposer();
    }
  });
  ui.prompt.addEventListener('input', autoGrow);
  ui.prompt.addEventListener('paste', function (ev) {
    if (!props || !props.multimodal || !ev.clipboardData) return;
    const file = Array.from(ev.clipboardData.files || []).find(function (f) { return /^image\//.test(f.type); });
    if (file) {
      ev.preventDefault();
      attachFile(file);
    }
  });
  ui.stop.addEventListener('click', function () { stop(); ui.prompt.focus(); });
  ui.newChat.addEventListener('click', newChat);
  ui.openSidebar.addEventListener('click', openSidebar);
  ui.closeSidebar.addEventListener('click', closeSidebar);
  ui.scrim.addEventListener('click', closeSidebar);
  ui.settingsToggle.addEventListener('click', function () { toggleSettings(); });
  for (const input of [ui.system, ui.temperature, ui.topP, ui.maxTokens, ui.seed, ui.tools]) {
    input.addEventListener('input', readSettings);
    input.addEventListener('change', function () { readSettings(); renderSettings(); });
  }
  ui.attach.addEventListener('click', function () { ui.fileInput.click(); });
  ui.fileInput.addEventListener('change', function () {
    const file = ui.fileInput.files && ui.fileInput.files[0];
    ui.fileInput.value = '';
    if (file) attachFile(file);
  });
  ui.messages.addEventListener('scroll', function () { stickToBottom = nearBottom(); });
  ui.messages.addEventListener('click', function (ev) {
    const button = ev.target.closest && ev.target.closest('button.copy-code');
    if (!button) return;
    const code = button.closest('.code-block').querySelector('pre code');
    copyText(code.textContent, button);
  });

  // Files dropped anywhere on the page: attach when the model takes images, and never navigate away.
  let dragDepth = 0;
  window.addEventListener('dragenter', function (ev) {
    if (!ev.dataTransfer || !Array.from(ev.dataTransfer.types || []).includes('Files')) return;
    dragDepth++;
    if (props && props.multimodal) ui.dropHint.hidden = false;
  });
  window.addEventListener('dragleave', function () {
    dragDepth = Math.max(0, dragDepth - 1);
    if (!dragDepth) ui.dropHint.hidden = true;
  });
  window.addEventListener('dragover', function (ev) {
    ev.preventDefault();
    if (ev.dataTransfer) ev.dataTransfer.dropEffect = props && props.multimodal ? 'copy' : 'none';
  });
  window.addEventListener('drop', function (ev) {
    ev.preventDefault();
    dragDepth = 0;
    ui.dropHint.hidden = true;
    const files = ev.dataTransfer ? Array.from(ev.dataTransfer.files || []) : [];
    const file = files.find(function (f) { return /^image\//.test(f.type); });
    if (file && props && props.multimodal) attachFile(file);
    else if (files.length) toast(props && props.multimodal ? 'Only images can be attached.' : 'This model does not take images.');
  });

  document.addEventListener('keydown', function (ev) {
    if (ev.key !== 'Escape' || ui.keyDialog.open) return;
    if (busy) {
      ev.preventDefault();
      stop();
    } else if (ui.app.classList.contains('sidebar-open')) {
      closeSidebar();
    } else if (!ui.settings.hidden && ui.settings.contains(document.activeElement)) {
      toggleSettings(false);
      ui.settingsToggle.focus();
    }
  });

  // Another tab changed the saved conversations: pick the changes up when idle.
  window.addEventListener('storage', function (ev) {
    if (ev.key !== STORE_KEY || busy) return;
    store = loadStore();
    renderAll();
  });

  window.addEventListener('resize', function () {
    if (!isNarrow()) {
      ui.app.classList.remove('sidebar-open');
      ui.scrim.hidden = true;
    }
  });

  renderAll();
  autoGrow();
  ui.prompt.focus();
  loadProps().then(function () {
    if (!current() || !current().messages.length) renderConversation();
  });
})();
