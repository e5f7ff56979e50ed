// Bedrock console: one page over the public API (docs/api.md), nothing else. No framework
// and no build step: the DOM is built with el() below, text always as text (textContent),
// and agent Markdown through marked then DOMPurify. The WebSocket carries the live frames
// and the client frames; REST does everything else.
'use strict';

// The page's own elements, looked up once before any content arrives: an id in rendered
// content can never stand in for one of them.
const ELEMENTS = new Map();
const $ = (id) => ELEMENTS.get(id) || document.getElementById(id);

// ---------------------------------------------------------------------------------------
// State

const S = {
  key: sessionStorage.getItem('bedrock.key') || '',
  dev: false,
  list: { items: [], cursor: null, archived: false },
  conv: null,          // the open conversation (Conversation JSON)
  ws: null,
  wsFor: null,         // the conversation id the socket belongs to
  lastEventId: 0,      // the newest durable frame seen of the open conversation
  messages: new Map(), // sequence_id -> Message
  requests: new Map(), // request_id -> {request_id, request_type, tool_use_id, expires}
  approvals: new Map(), // request_id -> approval_request event
  retrying: null,      // the last retrying frame of the running turn
  tree: [],            // root conversation and its sub-agents
  tasks: new Map(),    // task_id -> Task
  progress: new Map(), // task_id -> {progress, message}
  pending: [],         // images to send: {media_type, data, url}
  reconnect: { attempt: 0, timer: null },
  outbox: null,        // the last send: {body, text}, until its message is stored
  gen: 0,              // counts opens: work for an earlier open is dropped
  snapshot: { eventId: 0, pending: new Set() },
  toolNodes: new Map(), // tool_use_id -> its call's element
  cards: new Map(),    // request_id -> its card
  listGen: 0,
  ping: null,
};

const BUSY = new Set(['awaiting_llm', 'llm_requesting', 'tool_executing', 'awaiting_sub_agents', 'cancelling']);

// The open conversation's trace (GET .../trace): its steps and the one shown.
const T = { steps: [], at: -1, gen: 0 };

// ---------------------------------------------------------------------------------------
// DOM helpers

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === 'class') node.className = v;
    else if (k === 'text') node.textContent = v;
    else if (k.startsWith('on')) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v === true ? '' : v);
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined || c === false) continue;
    node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return node;
}

function markdown(text) {
  const div = el('div', { class: 'md' });
  if (window.marked && window.DOMPurify) {
    // No forms, no ids, names, classes or data attributes: Markdown cannot make controls or
    // pose as the page's own elements.
    div.innerHTML = DOMPurify.sanitize(marked.parse(text, { gfm: true, breaks: true }), SANITIZE);
    for (const a of div.querySelectorAll('a')) {
      a.setAttribute('target', '_blank');
      a.setAttribute('rel', 'noopener noreferrer');
    }
  } else {
    div.textContent = text;
  }
  return div;
}

const SANITIZE = {
  FORBID_TAGS: ['form', 'input', 'textarea', 'button', 'select', 'option', 'style', 'iframe', 'dialog'],
  FORBID_ATTR: ['id', 'name', 'class', 'style', 'for', 'form', 'tabindex'],
  ALLOW_DATA_ATTR: false,
  SANITIZE_NAMED_PROPS: true,
};

let toastTimer = null;
function toast(message) {
  const t = $('toast');
  t.textContent = message;
  t.hidden = false;
  clearTimeout(toastTimer);
  toastTimer = setTimeout(() => { t.hidden = true; }, 8000);
}

function banner(message) {
  const b = $('banner');
  b.textContent = message || '';
  b.hidden = !message;
}

function uuid() {
  if (crypto.randomUUID) return crypto.randomUUID();
  const b = crypto.getRandomValues(new Uint8Array(16));
  b[6] = (b[6] & 0x0f) | 0x40; b[8] = (b[8] & 0x3f) | 0x80;
  const h = [...b].map((x) => x.toString(16).padStart(2, '0')).join('');
  return `${h.slice(0, 8)}-${h.slice(8, 12)}-${h.slice(12, 16)}-${h.slice(16, 20)}-${h.slice(20)}`;
}

// ---------------------------------------------------------------------------------------
// REST

class ApiError extends Error {
  constructor(status, code, message) { super(message); this.status = status; this.code = code; }
}

const UNAUTHORIZED = 'The server refused the API key (401 unauthorized). Check the key, or create one with `bedrock tenant create NAME`.';

async function api(method, path, body) {
  const headers = {};
  if (S.key) headers.Authorization = `Bearer ${S.key}`;
  if (body !== undefined) headers['Content-Type'] = 'application/json';
  let r;
  try {
    r = await fetch(path, { method, headers, body: body === undefined ? undefined : JSON.stringify(body) });
  } catch (e) {
    throw new ApiError(0, 'unreachable', 'The server cannot be reached.');
  }
  if (r.status === 204) return null;
  const data = await r.json().catch(() => null);
  if (!r.ok) {
    const code = data?.error?.code || `http_${r.status}`;
    const message = data?.error?.message || r.statusText;
    if (r.status === 401) signOut(S.key ? UNAUTHORIZED : '');
    throw new ApiError(r.status, code, message);
  }
  return data;
}

function failed(e) {
  if (e.status === 401) return;
  toast(e.code && e.code !== 'unreachable' ? `${e.message} (${e.code})` : e.message);
}

const enc = encodeURIComponent;
const convPath = (id, rest = '') => `/v1/conversations/${enc(id)}${rest}`;

// ---------------------------------------------------------------------------------------
// Sign-in

async function start() {
  for (const node of document.querySelectorAll('[id]')) ELEMENTS.set(node.id, node);
  wire();
  // Without a key: a 200 means dev mode (the server acts as tenant `default`).
  try {
    await api('GET', '/v1/conversations?limit=1');
    S.dev = !S.key;
    showApp();
  } catch (e) {
    if (e.status !== 401) showSignIn(e.message);
  }
}

function showSignIn(message) {
  $('app').hidden = true;
  $('signout').hidden = true;
  $('mode').textContent = '';
  $('signin').hidden = false;
  $('signin-error').textContent = message || '';
  $('api-key').focus();
}

function showApp() {
  $('signin').hidden = true;
  $('app').hidden = false;
  $('signout').hidden = S.dev;
  $('mode').textContent = S.dev ? 'dev mode: no key needed on this loopback server' : '';
  loadList(true);
  route();
}

function signOut(message) {
  sessionStorage.removeItem('bedrock.key');
  S.key = '';
  closeSocket();
  S.conv = null;
  showSignIn(message);
}

async function signIn(ev) {
  ev.preventDefault();
  const key = $('api-key').value.trim();
  if (!key) return;
  S.key = key;
  try {
    await api('GET', '/v1/conversations?limit=1');
  } catch (e) {
    if (e.status !== 401) { $('signin-error').textContent = e.message; }
    S.key = '';
    return;
  }
  sessionStorage.setItem('bedrock.key', key);
  $('api-key').value = '';
  S.dev = false;
  showApp();
}

// ---------------------------------------------------------------------------------------
// Conversation list

function title(c) { return c.slug || c.id; }

function stateLabel(state, retrying) {
  switch (state.kind) {
    case 'llm_requesting':
      if (retrying) return `retrying: attempt ${retrying.attempt}, in ${(retrying.delay_ms / 1000).toFixed(1)} s (${retrying.error_kind})`;
      return state.attempt > 1 ? `llm_requesting (attempt ${state.attempt})` : 'llm_requesting';
    case 'tool_executing': {
      const n = (state.remaining_tool_ids || []).length;
      return `tool_executing${n ? ` (+${n} queued)` : ''}`;
    }
    case 'awaiting_sub_agents':
      return `awaiting_sub_agents (${state.completed} done, ${(state.pending_ids || []).length} running)`;
    case 'error': return `error: ${state.error_kind}`;
    default: return state.kind;
  }
}

function badge(state, retrying) {
  const b = el('span', { class: 'badge', text: stateLabel(state, retrying) });
  setBadgeClass(b, state, retrying);
  return b;
}

function setBadgeClass(b, state, retrying) {
  b.className = 'badge';
  if (retrying && state.kind === 'llm_requesting') b.classList.add('retrying');
  else if (state.kind === 'cancelling') b.classList.add('cancelling');
  else if (BUSY.has(state.kind)) b.classList.add('busy');
  else if (state.kind === 'error') b.classList.add('error');
  else if (state.kind === 'completed') b.classList.add('completed');
  b.dataset.kind = state.kind;
}

async function loadList(reset) {
  const L = S.list;
  const gen = ++S.listGen;
  const q = new URLSearchParams({ limit: '20', archived: String(L.archived) });
  if (!reset && L.cursor) q.set('cursor', L.cursor);
  try {
    const page = await api('GET', `/v1/conversations?${q}`);
    if (gen !== S.listGen) return; // a later load replaces this one
    const seen = new Set(reset ? [] : L.items.map((c) => c.id));
    L.items = [...(reset ? [] : L.items), ...page.conversations.filter((c) => !seen.has(c.id))];
    L.cursor = page.next_cursor || null;
  } catch (e) { failed(e); }
  renderList();
}

function renderList() {
  const ul = $('conversations');
  ul.replaceChildren(...S.list.items.map((c) => {
    const current = S.conv && S.conv.id === c.id;
    return el('li', { class: current ? 'current' : null, 'data-id': c.id },
      el('button', { type: 'button', class: 'open', title: c.id, onclick: () => open(c.id), 'aria-current': current ? 'page' : null },
        el('span', { class: 'name' }, title(c)), el('span', { class: `badge ${c.state.kind}`, title: stateLabel(c.state) }, c.state.kind)),
      c.archived
        ? el('button', { type: 'button', class: 'small', onclick: () => archive(c, false), 'aria-label': `Unarchive ${title(c)}` }, 'Unarchive')
        : el('button', { type: 'button', class: 'small', onclick: () => archive(c, true), 'aria-label': `Archive ${title(c)}` }, 'Archive'),
      el('button', { type: 'button', class: 'small danger', onclick: () => remove(c), 'aria-label': `Delete ${title(c)}` }, 'Delete'));
  }));
  if (!S.list.items.length) ul.append(el('li', { class: 'muted small' }, S.list.archived ? 'No archived conversations.' : 'No conversations yet.'));
  $('more').hidden = !S.list.cursor;
}

// The tenant's agents, each at its latest version, offered when creating a conversation.
async function loadAgents() {
  try {
    const { agents } = await api('GET', '/v1/agents');
    const select = $('new-agent');
    const chosen = select.value;
    select.replaceChildren(select.options[0],
      ...agents.map((a) => el('option', { value: `${a.name}@${a.version}` },
        `${a.name} (v${a.version}, ${a.model})`)));
    select.value = [...select.options].some((o) => o.value === chosen) ? chosen : '';
    agentChosen();
  } catch (e) { if (e.status !== 401) failed(e); }
}

// An agent owns its model and prompt: those fields are off while one is chosen.
function agentChosen() {
  const agent = $('new-agent').value;
  for (const id of ['new-model', 'new-system']) $(id).disabled = Boolean(agent);
}

async function create(ev) {
  ev.preventDefault();
  const body = {};
  const agent = $('new-agent').value;
  const fields = agent
    ? [['slug', 'new-slug'], ['cwd', 'new-cwd']]
    : [['slug', 'new-slug'], ['cwd', 'new-cwd'], ['model', 'new-model'], ['system_prompt', 'new-system']];
  if (agent) body.agent = agent;
  for (const [field, id] of fields) {
    const v = $(id).value.trim();
    if (v) body[field] = v;
  }
  $('create-error').textContent = '';
  try {
    const c = await api('POST', '/v1/conversations', body);
    $('create-form').reset();
    agentChosen();
    $('create').open = false;
    if (S.list.archived) { S.list.archived = false; $('show-archived').checked = false; }
    await loadList(true);
    open(c.id);
  } catch (e) {
    if (e.status !== 401) $('create-error').textContent = `${e.message} (${e.code})`;
  }
}

async function archive(c, yes) {
  try {
    await api('POST', convPath(c.id, yes ? '/archive' : '/unarchive'));
    await loadList(true);
  } catch (e) { failed(e); }
}

async function remove(c) {
  if (!confirm(`Delete ${title(c)} with its messages and sub-agents? This cannot be undone.`)) return;
  try {
    await api('DELETE', convPath(c.id));
    if (S.conv && S.conv.id === c.id) { location.hash = ''; }
    await loadList(true);
  } catch (e) { failed(e); }
}

// ---------------------------------------------------------------------------------------
// Opening a conversation (the URL's hash is #/c/<id>, so a reload reopens it)

function open(id) {
  const hash = `#/c/${enc(id)}`;
  if (location.hash !== hash) location.hash = hash; else route();
}

function route() {
  const m = location.hash.match(/^#\/c\/(.+)$/);
  if (!m) { closeConversation(); return; }
  const id = decodeURIComponent(m[1]);
  if (S.conv && S.conv.id === id && S.ws) return;
  openConversation(id);
}

function closeConversation() {
  closeSocket();
  S.conv = null;
  $('chat').hidden = true;
  $('empty').hidden = false;
  renderList();
}

async function openConversation(id) {
  const gen = ++S.gen;
  closeSocket();
  delete $('chat').dataset.live;
  S.conv = null;
  let conv;
  try {
    conv = await api('GET', convPath(id));
  } catch (e) {
    if (gen !== S.gen) return;
    failed(e);
    if (e.status === 404) location.hash = '';
    return;
  }
  if (gen !== S.gen) return; // another conversation was opened meanwhile
  S.conv = conv;
  S.lastEventId = 0;
  S.snapshot = { eventId: 0, pending: new Set() };
  S.messages.clear();
  S.requests.clear();
  S.approvals.clear();
  S.cards.clear();
  S.toolNodes.clear();
  S.tasks.clear();
  S.progress.clear();
  S.retrying = null;
  S.outbox = null;
  S.tree = [];
  closeTrace();
  $('messages').replaceChildren();
  $('requests').replaceChildren();
  $('tasks').replaceChildren();
  $('older').hidden = true;
  setStreaming('');
  $('empty').hidden = true;
  $('chat').hidden = false;
  renderHead();
  renderList();
  connect();
  loadTree();
  loadTasks();
  $('text').focus();
}

function renderHead() {
  const c = S.conv;
  $('chat-title').textContent = title(c);
  $('chat-title').title = c.id;
  $('chat-cwd').textContent = c.agent
    ? `${c.cwd} · ${c.model} · agent ${c.agent.name}@${c.agent.version}`
    : `${c.cwd} · ${c.model}`;
  const parent = $('chat-parent');
  parent.hidden = !c.parent_id;
  if (c.parent_id) parent.href = `#/c/${enc(c.parent_id)}`;
  renderState();
  renderContext(c.usage);
  // A sub-agent is driven by its parent: no composer.
  $('composer').hidden = !c.user_initiated;
}

function renderState() {
  const state = S.conv.state;
  const b = $('state');
  b.textContent = stateLabel(state, S.retrying);
  setBadgeClass(b, state, S.retrying);
  $('cancel').disabled = !(BUSY.has(state.kind) && state.kind !== 'cancelling');
  // The context is full: the conversation goes on from its summary in a new one.
  $('continue').hidden = state.kind !== 'context_exhausted';
  const item = S.list.items.find((c) => c.id === S.conv.id);
  if (item) {
    item.state = state;
    const li = [...$('conversations').children].find((n) => n.dataset.id === item.id);
    const small = li && li.querySelector('.open .badge');
    if (small) { small.className = `badge ${state.kind}`; small.textContent = state.kind; small.title = stateLabel(state); }
  }
  const node = treeBadges().get(S.conv.id);
  if (node) { node.textContent = stateLabel(state); setBadgeClass(node, state); }
}

function renderContext(usage) {
  if (!usage || !usage.context_window) return;
  const ratio = Math.min(1, usage.context_tokens / usage.context_window);
  const meter = $('context');
  $('context-fill').style.width = `${(ratio * 100).toFixed(1)}%`;
  $('context-text').textContent = `${usage.context_tokens.toLocaleString()} / ${usage.context_window.toLocaleString()} tokens`;
  meter.classList.toggle('warn', ratio >= 0.8 && ratio < 0.95);
  meter.classList.toggle('danger', ratio >= 0.95);
  meter.setAttribute('role', 'meter');
  meter.setAttribute('aria-label', 'Context window used');
  meter.setAttribute('aria-valuemin', '0');
  meter.setAttribute('aria-valuemax', String(usage.context_window));
  meter.setAttribute('aria-valuenow', String(usage.context_tokens));
}

// ---------------------------------------------------------------------------------------
// The live stream

function closeSocket() {
  clearTimeout(S.reconnect.timer);
  S.reconnect.timer = null;
  S.reconnect.attempt = 0;
  clearInterval(S.ping);
  S.ping = null;
  banner('');
  if (S.ws) {
    S.ws.onclose = null;
    S.ws.close(1000);
    S.ws = null;
  }
  S.wsFor = null;
}

function connect() {
  if (S.ws) closeSocket();
  const id = S.conv.id;
  const gen = S.gen;
  const q = new URLSearchParams();
  if (S.lastEventId) q.set('after_event_id', String(S.lastEventId));
  const proto = location.protocol === 'https:' ? 'wss' : 'ws';
  // The key travels as a subprotocol, a header proxies do not log (never in the URL).
  const ws = new WebSocket(`${proto}://${location.host}${convPath(id, '/ws')}?${q}`,
    S.key ? ['bedrock', `bearer.${S.key}`] : undefined);
  S.ws = ws;
  S.wsFor = id;
  // A ping every 25 s keeps proxies from closing an idle socket, and a socket that no
  // longer answers is noticed: no pong by the next ping, and it is dropped and reopened.
  let answered = true;
  ws.onmessage = (ev) => {
    let frame;
    try { frame = JSON.parse(ev.data); } catch { return; }
    if (frame.type === 'pong') { answered = true; return; }
    if (S.ws === ws) onFrame(frame);
  };
  ws.onclose = () => { if (S.ws === ws) lost(id, gen); };
  S.ping = setInterval(() => {
    if (ws.readyState !== WebSocket.OPEN) return;
    if (!answered) { ws.close(); return; }
    answered = false;
    ws.send('{"type":"ping"}');
  }, 25000);
}

// A dropped connection (a restart, a network blip): reconnect after a back-off, asking for
// the frames after the last one seen. REST tells apart a gone conversation or key.
function lost(id, gen) {
  if (gen !== S.gen) return;
  delete $('chat').dataset.live;
  S.ws = null;
  clearInterval(S.ping);
  S.ping = null;
  setStreaming('');
  const attempt = ++S.reconnect.attempt;
  const delay = Math.min(5000, 250 * 2 ** Math.min(attempt, 5));
  banner(`Connection lost: reconnecting (attempt ${attempt})…`);
  S.reconnect.timer = setTimeout(async () => {
    if (gen !== S.gen) return;
    try {
      await api('GET', convPath(id));
    } catch (e) {
      if (gen !== S.gen) return;
      if (e.status === 404) { banner(''); toast('This conversation no longer exists.'); location.hash = ''; return; }
      if (e.status === 401) { banner(''); return; }
      lost(id, gen);
      return;
    }
    if (gen === S.gen && !S.ws) connect();
  }, delay);
}

function onFrame(f) {
  if (f.event_id && f.type !== 'snapshot') {
    if (f.event_id <= S.lastEventId) return; // already seen (a replay's overlap)
    S.lastEventId = f.event_id;
  }
  switch (f.type) {
    case 'snapshot': return onSnapshot(f);
    case 'state':
      S.conv.state = f.state;
      if (f.state.kind !== 'llm_requesting') setRetrying(null);
      if (!BUSY.has(f.state.kind)) setStreaming('');
      renderState();
      if (!$('queue-panel').hidden || f.state.kind === 'awaiting_llm') loadQueue();
      if (f.state.kind === 'awaiting_sub_agents' || f.state.kind === 'idle') loadTree();
      return;
    case 'message': return onMessage(f.message);
    case 'delta': if (f.text) setStreaming(($('streaming').textContent || '') + f.text); return;
    case 'retrying': setStreaming(''); setRetrying(f); return;
    case 'tool_progress': return onProgress(f);
    case 'sub_agent': return onSubAgent(f);
    case 'client_request':
      // A replay after a reconnect re-sends requests the snapshot already knows are over.
      if (f.event_id <= S.snapshot.eventId && !S.snapshot.pending.has(f.request_id)) return;
      addRequest({ request_id: f.request_id, request_type: f.request_type, tool_use_id: f.tool_use_id, expires: Date.now() + f.timeout_ms });
      return;
    case 'client_request_resolved': return removeRequest(f.request_id);
    case 'client_tool_call':
      if (f.event_id <= S.snapshot.eventId && !S.snapshot.pending.has(f.call_id)) return;
      addRequest(toolCall(f));
      return;
    case 'client_tool_resolved': return removeRequest(f.call_id);
    case 'context_warning': return renderContext({ context_tokens: f.context_tokens, context_window: f.context_window });
    case 'system_event': return onSystemEvent(f.event);
    case 'rejected': return onRejected(f);
    default: return undefined;
  }
}

function setRetrying(f) {
  clearTimeout(S.retryTimer);
  S.retrying = f;
  // Once its delay is over, the next attempt is running: the badge says so.
  if (f) S.retryTimer = setTimeout(() => { S.retrying = null; if (S.conv) renderState(); }, f.delay_ms);
  if (S.conv) renderState();
}

function newestSeq() {
  let newest = 0;
  for (const seq of S.messages.keys()) if (seq > newest) newest = seq;
  return newest;
}

function onSnapshot(f) {
  S.reconnect.attempt = 0;
  banner('');
  $('chat').dataset.live = 'true'; // the live stream is up (tests wait for it)
  const resumed = S.messages.size > 0;
  const newest = newestSeq();
  S.conv = f.conversation;
  const calls = f.pending_client_tool_calls || [];
  S.snapshot = { eventId: f.event_id, pending: new Set([...f.pending_requests.map((r) => r.request_id), ...calls.map((c) => c.call_id)]) };
  setRetrying(null);
  renderHead();
  // Pending requests are the snapshot's: any other was answered while away.
  const live = S.snapshot.pending;
  for (const id of [...S.requests.keys()]) if (!live.has(id)) removeRequest(id);
  for (const r of f.pending_requests) {
    addRequest({ request_id: r.request_id, request_type: r.request_type, tool_use_id: r.tool_use_id, expires: Date.parse(r.expires_at) });
  }
  for (const c of calls) addRequest(toolCall(c));
  for (const m of f.messages) onMessage(m);
  // Messages between what was shown and the snapshot's window come from REST.
  if (resumed && f.messages.length && f.messages[0].sequence_id > newest + 1) {
    fillGap(newest, f.messages[0].sequence_id);
  }
  if (!S.lastEventId) S.lastEventId = f.event_id;
  if (!resumed) $('older').hidden = !(f.messages.length && f.messages[0].sequence_id > 1);
  resendOutbox();
  loadQueue();
  scrollDown();
}

// Fetches the messages after `after` and before `until` over REST.
async function fillGap(after, until) {
  const gen = S.gen;
  try {
    while (after + 1 < until) {
      const limit = Math.min(1000, until - after - 1);
      const page = await api('GET', `${convPath(S.conv.id, '/messages')}?after=${after}&limit=${limit}`);
      if (gen !== S.gen) return;
      for (const m of page.messages) onMessage(m);
      if (page.messages.length < limit) break;
      after = page.messages[page.messages.length - 1].sequence_id;
    }
  } catch (e) { failed(e); }
}

async function loadOlder() {
  if (!S.messages.size) return;
  const gen = S.gen;
  const first = Math.min(...S.messages.keys());
  const after = Math.max(0, first - 51);
  try {
    const page = await api('GET', `${convPath(S.conv.id, '/messages')}?after=${after}&limit=${first - 1 - after}`);
    if (gen !== S.gen) return;
    for (const m of page.messages) onMessage(m);
    $('older').hidden = after === 0;
  } catch (e) { failed(e); }
}

function scrollDown() {
  const wrap = document.querySelector('.timeline-wrap');
  wrap.scrollTop = wrap.scrollHeight;
}

function setStreaming(text) {
  const s = $('streaming');
  s.textContent = text;
  s.hidden = !text;
  if (text) scrollDown();
}

// ---------------------------------------------------------------------------------------
// Messages

function onMessage(m) {
  if (S.messages.has(m.sequence_id)) return; // shown already: no duplicates
  const latest = m.sequence_id > newestSeq();
  S.messages.set(m.sequence_id, m);
  if (latest && m.usage) renderContext(m.usage);
  if (latest && m.message_type === 'agent') setStreaming('');
  if (S.outbox && m.message_type === 'user' && m.message_id === S.outbox.body.message_id) S.outbox = null;
  const node = renderMessage(m);
  // In sequence order, wherever it lands (a gap filled late, older pages).
  const list = $('messages');
  const after = latest ? null : [...list.children].find((li) => Number(li.dataset.seq) > m.sequence_id);
  list.insertBefore(node, after || null);
  if (m.message_type === 'tool') attachResult(m);
  else if (m.message_type === 'agent') for (const t of m.content.tool_uses || []) {
    const result = [...S.messages.values()].find((x) => x.message_type === 'tool' && x.content.tool_use_id === t.id);
    if (result) attachResult(result);
  }
  if (m.message_type === 'tool') loadTasksSoon();
  if (!after) scrollDown();
}

function renderMessage(m) {
  const c = m.content || {};
  const meta = el('div', { class: 'meta' }, `#${m.sequence_id} ${m.message_type} · ${new Date(m.created_at).toLocaleTimeString()}`);
  const li = el('li', { class: `msg ${m.message_type}`, 'data-seq': m.sequence_id, 'data-type': m.message_type }, meta);
  switch (m.message_type) {
    case 'user': {
      li.append(el('div', { class: 'text' }, c.text || ''));
      if (c.images && c.images.length) {
        const thumbs = el('div', { class: 'thumbs' });
        for (const img of c.images) thumbs.append(thumbnail(m.conversation_id, img));
        li.append(thumbs);
      }
      break;
    }
    case 'agent':
      if (c.text) li.append(markdown(c.text));
      for (const t of c.tool_uses || []) {
        const call = el('div', { class: 'tool-call', 'data-tool-use-id': t.id },
          el('div', {}, el('span', { class: 'tool-name' }, t.name), el('span', { class: 'status muted' }, 'running…')),
          el('details', {}, el('summary', {}, 'input'), el('pre', {}, JSON.stringify(t.input, null, 2))),
          el('div', { class: 'result' }));
        S.toolNodes.set(t.id, call);
        li.append(call);
      }
      break;
    case 'tool':
      li.hidden = true; // shown inside its call; see attachResult
      li.append(el('div', {}, `${c.name}: ${c.ok ? 'ok' : 'failed'}`), el('pre', {}, c.output));
      break;
    default:
      li.append(el('div', { class: 'text' }, c.text || ''));
  }
  return li;
}

function messageNode(seq) {
  return [...$('messages').children].find((li) => Number(li.dataset.seq) === seq);
}

function attachResult(m) {
  const c = m.content;
  const call = S.toolNodes.get(c.tool_use_id);
  const own = messageNode(m.sequence_id);
  // Shown on its own only while its call is not loaded.
  if (own) own.hidden = Boolean(call);
  if (!call) return;
  const status = call.querySelector('.status');
  const kind = c.cancelled ? 'cancelled' : c.ok ? 'ok' : 'failed';
  status.className = `status ${kind}`;
  status.textContent = kind;
  const lines = (c.output || '').replace(/\n$/, '').split('\n').length;
  call.querySelector('.result').replaceChildren(
    el('details', { open: !c.ok || lines <= 6 ? true : null },
      el('summary', {}, `output (${lines} line${lines === 1 ? '' : 's'})`),
      el('pre', { class: 'output' }, c.output || '')));
}

function thumbnail(convId, img) {
  const node = el('img', { alt: `attached image (${img.media_type})`, 'data-image-id': img.id });
  const headers = S.key ? { Authorization: `Bearer ${S.key}` } : {};
  fetch(`${convPath(convId, '/images/')}${enc(img.id)}`, { headers })
    .then((r) => (r.ok ? r.blob() : null))
    .then((blob) => { if (blob) node.src = URL.createObjectURL(blob); })
    .catch(() => {});
  return node;
}

function onSystemEvent(event) {
  if (event.type === 'approval_request' && event.request_id) {
    S.approvals.set(event.request_id, event);
    const card = S.cards.get(event.request_id);
    if (card) renderRequestCard(S.requests.get(event.request_id), card);
    return;
  }
  if (event.type === 'tool_result') loadTasksSoon();
  if (event.type === 'system_notice' || event.type === 'system_error') {
    const text = event.message || event.text || JSON.stringify(event);
    // Not a stored message: no sequence id, so later messages go after it.
    $('messages').append(el('li', { class: `msg ${event.type === 'system_error' ? 'error' : 'system'}`, 'data-notice': event.type }, text));
    scrollDown();
  }
}

function onRejected(f) {
  toast(`${f.message} (${f.code})`);
  // A refused send gives its text back; a refused answer frees its card's buttons.
  if (S.outbox && S.outbox.sent) {
    if (!$('text').value) $('text').value = S.outbox.text;
    S.outbox = null;
  }
  for (const card of S.cards.values()) for (const b of card.querySelectorAll('button')) b.disabled = false;
}

// ---------------------------------------------------------------------------------------
// Messages that wait for the running turn (issue 39)

// ---------------------------------------------------------------------------------------
// Trace: each step of the conversation's core, re-run by the server from its replay log
// (docs/api.md, "Trace"): the event, the states before and after, what it started.

function effectName(e) { return typeof e === 'string' ? e : Object.keys(e || {})[0] || '?'; }

// An effect as a line: its name and what it names (the tool, the message's type, the step).
function effectLabel(e) {
  const name = effectName(e);
  const v = (typeof e === 'object' && e[name]) || {};
  switch (name) {
    case 'execute_tool': return `execute_tool ${v.tool?.name ?? ''} (${v.tool?.id ?? ''})`;
    case 'persist_message': return `persist_message: ${Object.keys(v)[0] ?? ''}`;
    case 'request_llm': return `request_llm: step ${v.request?.step}, attempt ${v.request?.attempt}`;
    case 'schedule_retry': return `schedule_retry in ${v.delay_ms} ms`;
    case 'cancel_tool': return `cancel_tool ${v.tool_use_id ?? ''}`;
    default: return name;
  }
}

function closeTrace() {
  T.gen++;
  T.steps = [];
  T.at = -1;
  $('trace-panel').hidden = true;
  $('trace-open').setAttribute('aria-expanded', 'false');
  $('trace-steps').replaceChildren();
  $('trace-detail').replaceChildren();
}

async function openTrace() {
  if (!S.conv) return;
  const gen = ++T.gen;
  const id = S.conv.id;
  $('trace-panel').hidden = false;
  $('trace-open').setAttribute('aria-expanded', 'true');
  $('trace-summary').textContent = 'Loading...';
  const steps = [];
  let after = 0;
  let skipped = 0;
  let divergence = null;
  let more = false;
  try {
    // At most a few pages: each page costs the server the steps up to its end.
    for (let pages = 0; ; pages++) {
      const page = await api('GET', convPath(id, `/trace?after=${after}&limit=500`));
      if (gen !== T.gen) return;
      steps.push(...page.steps);
      skipped = page.skipped;
      divergence = page.divergence || divergence;
      if (page.next_cursor === null || page.next_cursor === undefined) break;
      after = page.next_cursor;
      if (pages === 3) { more = true; break; }
    }
  } catch (e) {
    if (gen === T.gen) { $('trace-summary').textContent = ''; failed(e); }
    return;
  }
  T.steps = steps;
  const differs = steps.filter((st) => !st.same).length;
  $('trace-summary').textContent = `${steps.length}${more ? '+' : ''} steps` +
    (more ? ' (the first shown)' : '') +
    (skipped ? `, ${skipped} before the retained log` : '') +
    (differs ? `; step ${steps.find((st) => !st.same).step} decides differently now` : '') +
    (divergence && !differs ? `; the trace ends at step ${divergence.step}: ${divergence.reason}` : '');
  $('trace-steps').replaceChildren(...steps.map((st, i) => el('li', {
    'data-step': st.step, role: 'option', 'aria-selected': 'false', class: st.same ? null : 'differs',
    onclick: () => showStep(i),
  }, el('span', { class: 'n' }, String(st.step)), el('span', {},
    `${st.kind}: ${st.state_before.kind} \u2192 ${st.state_after.kind}`))));
  showStep(steps.length ? steps.length - 1 : -1);
}

function showStep(i) {
  if (i < 0 || i >= T.steps.length) return;
  T.at = i;
  const st = T.steps[i];
  for (const li of $('trace-steps').children) li.setAttribute('aria-selected', String(Number(li.dataset.step) === st.step));
  $('trace-steps').children[i]?.scrollIntoView({ block: 'nearest' });
  const effects = (st.effects || []).map((e) => el('li', {}, effectLabel(e)));
  const jump = st.message !== null && st.message !== undefined
    ? el('button', { type: 'button', class: 'small', onclick: () => jumpToMessage(st.message) }, `Show message ${st.message}`)
    : null;
  $('trace-detail').replaceChildren(
    el('h4', {}, `Step ${st.step}: ${st.kind}`, st.same ? '' : ' (decides differently now)'),
    el('div', { class: 'muted small' }, new Date(st.at).toLocaleString()),
    el('div', {}, `State: ${st.state_before.kind} \u2192 ${st.state_after.kind}`),
    jump,
    el('div', {}, effects.length ? 'Started:' : 'Started nothing.'),
    effects.length ? el('ol', { class: 'effects' }, effects) : null,
    el('details', {}, el('summary', {}, 'Event'), el('pre', {}, JSON.stringify(st.event, null, 2))),
    el('details', {}, el('summary', {}, 'Effects'), el('pre', {}, JSON.stringify(st.effects, null, 2))),
    el('details', {}, el('summary', {}, 'State after'), el('pre', {}, JSON.stringify(st.state_after, null, 2))),
  );
  $('trace-prev').disabled = i === 0;
  $('trace-next').disabled = i === T.steps.length - 1;
}

async function jumpToMessage(seq) {
  let node = messageNode(seq);
  // Earlier messages are loaded until it shows (or there are none left).
  for (let pages = 0; !node && !$('older').hidden && pages < 200; pages++) {
    const before = S.messages.size;
    await loadOlder();
    node = messageNode(seq);
    if (S.messages.size === before) break;
  }
  if (!node) { toast(`Message ${seq} is not in the history.`); return; }
  // A tool's result shows inside its call.
  const content = S.messages.get(seq)?.content;
  const target = node.hidden ? (S.toolNodes.get(content?.tool_use_id) || node) : node;
  target.scrollIntoView({ block: 'center' });
  target.classList.add('highlight');
  setTimeout(() => target.classList.remove('highlight'), 2000);
}

async function loadQueue() {
  if (!S.conv) return;
  const gen = S.gen;
  let queued = [];
  try {
    queued = (await api('GET', convPath(S.conv.id, '/queue'))).queued;
  } catch (e) { if (e.status !== 404) failed(e); }
  if (gen !== S.gen) return;
  $('queue-panel').hidden = queued.length === 0;
  $('queue').replaceChildren(...queued.map((m) => el('li', { 'data-queued-id': m.queued_id },
    el('span', { class: 'muted small' }, m.kind === 'steer' ? 'next step: ' : 'next turn: '),
    el('span', {}, m.text),
    el('button', { type: 'button', class: 'small danger', onclick: () => takeBack(m.queued_id) }, 'Take back'))));
}

async function takeBack(id) {
  try {
    await api('DELETE', convPath(S.conv.id, `/queue/${enc(id)}`));
  } catch (e) { if (e.status !== 404) failed(e); }
  loadQueue();
}

// ---------------------------------------------------------------------------------------
// Sending

async function send(ev) {
  if (ev) ev.preventDefault();
  if (!S.conv) return;
  const text = $('text').value;
  if (!text.trim() && !S.pending.length) return;
  const body = { text, message_id: uuid() };
  if (S.pending.length) body.images = S.pending.map(({ media_type, data }) => ({ media_type, data }));
  $('text').value = '';
  clearAttachments();
  // While a turn runs, the message waits for it (if_busy=enqueue) and shows in the queue.
  if (S.conv.state && BUSY.has(S.conv.state.kind)) {
    try {
      await api('POST', convPath(S.conv.id, '/messages?if_busy=enqueue'), body);
    } catch (e) {
      failed(e);
      if (!$('text').value) $('text').value = text;
    }
    loadQueue();
    return;
  }
  S.outbox = { body, text, sent: false };
  if (S.ws && S.ws.readyState === WebSocket.OPEN) {
    S.outbox.sent = true;
    S.ws.send(JSON.stringify({ type: 'user_message', ...body }));
    return;
  }
  await postOutbox();
}

// Over REST, with the same message_id: a send that did get stored is not stored twice.
async function postOutbox() {
  const out = S.outbox;
  if (!out) return;
  const gen = S.gen;
  try {
    const r = await api('POST', convPath(S.conv.id, '/messages'), out.body);
    if (gen === S.gen) onMessage(r.message);
  } catch (e) {
    failed(e);
    if (gen === S.gen && S.outbox === out && !$('text').value) $('text').value = out.text;
  } finally {
    if (S.outbox === out) S.outbox = null;
  }
}

// After a reconnect: a send that went out on the old socket and is not stored yet goes again.
function resendOutbox() {
  const out = S.outbox;
  if (!out || !out.sent) return;
  const stored = [...S.messages.values()].some((m) => m.message_id === out.body.message_id);
  if (stored) { S.outbox = null; return; }
  postOutbox();
}

async function continueConversation() {
  if (!S.conv) return;
  $('continue').disabled = true;
  try {
    const next = await api('POST', convPath(S.conv.id, '/continue'));
    await loadList(true);
    open(next.id);
  } catch (e) { failed(e); } finally { $('continue').disabled = false; }
}

async function cancel() {
  if (!S.conv) return;
  $('cancel').disabled = true;
  setTimeout(() => { if (S.conv) renderState(); }, 3000);
  if (S.ws && S.ws.readyState === WebSocket.OPEN) { S.ws.send(JSON.stringify({ type: 'cancel' })); return; }
  try { await api('POST', convPath(S.conv.id, '/cancel')); } catch (e) { failed(e); }
}

const MEDIA = ['image/png', 'image/jpeg', 'image/gif', 'image/webp'];

function addFiles(files) {
  for (const file of files) {
    if (!MEDIA.includes(file.type)) { toast(`${file.name || 'That file'} is not a PNG, JPEG, GIF or WebP image.`); continue; }
    const reader = new FileReader();
    reader.onload = () => {
      const data = String(reader.result).split(',', 2)[1] || '';
      S.pending.push({ media_type: file.type, data, url: URL.createObjectURL(file) });
      renderAttachments();
    };
    reader.readAsDataURL(file);
  }
}

function renderAttachments() {
  $('attachments').replaceChildren(...S.pending.map((p, i) => el('div', { class: 'att' },
    el('img', { src: p.url, alt: `image to send ${i + 1}` }),
    el('button', { type: 'button', 'aria-label': `Remove image ${i + 1}`, onclick: () => { URL.revokeObjectURL(p.url); S.pending.splice(i, 1); renderAttachments(); } }, '×'))));
}

function clearAttachments() {
  for (const p of S.pending) URL.revokeObjectURL(p.url);
  S.pending = [];
  renderAttachments();
}

// ---------------------------------------------------------------------------------------
// Requests from the server (questions and approvals)

function addRequest(r) {
  if (S.requests.has(r.request_id)) return;
  S.requests.set(r.request_id, r);
  const card = el('form', { class: 'request', 'data-request-id': r.request_id });
  S.cards.set(r.request_id, card);
  renderRequestCard(r, card);
  $('requests').append(card);
  // The form takes the focus, on its heading (a stray key answers nothing), unless the
  // user is typing a message.
  if (document.activeElement !== $('text') || !$('text').value) card.querySelector('h3').focus();
}

function removeRequest(id) {
  S.requests.delete(id);
  S.approvals.delete(id);
  const card = S.cards.get(id);
  S.cards.delete(id);
  if (!card) return;
  const focused = card.contains(document.activeElement);
  card.remove();
  if (focused) $('text').focus();
}

// An approval: from its approval_request event, or (after a reload, which has no events)
// from the confirm message the server writes for it.
function approvalOf(r, kind, spec) {
  const event = S.approvals.get(r.request_id);
  if (event) return { tool: event.tool_name, input: JSON.stringify(event.input, null, 2) };
  const m = kind === 'confirm' && r.tool_use_id && /^Allow the agent to run (\S+)\?\n([\s\S]*)$/.exec(spec.message || '');
  return m ? { tool: m[1], input: m[2] } : null;
}

// A call of a client tool (a client_tool_call frame, or the snapshot's pending one), shown
// as a card like a request: the console answers it by hand.
function toolCall(c) {
  return { request_id: c.call_id, tool_use_id: c.tool_use_id, client_tool: { name: c.name, input: c.input }, expires: Date.parse(c.expires_at) };
}

function renderToolCallCard(r, card) {
  const headingId = `rqh-${r.request_id}`;
  card.setAttribute('aria-labelledby', headingId);
  const countdown = el('span', { class: 'countdown', 'data-expires': r.expires });
  const output = el('textarea', { rows: 4, 'aria-label': 'The tool\'s output' }, '');
  const answer = (isError) => {
    for (const b of card.querySelectorAll('button')) b.disabled = true;
    answerToolCall(r.request_id, output.value, isError);
  };
  card.onsubmit = (ev) => { ev.preventDefault(); answer(false); };
  card.replaceChildren(
    el('h3', { id: headingId, tabindex: '-1' }, countdown, `Client tool: ${r.client_tool.name}`),
    el('pre', {}, JSON.stringify(r.client_tool.input, null, 2)),
    output,
    el('div', { class: 'actions' },
      el('button', { type: 'submit' }, 'Send result'),
      el('button', { type: 'button', class: 'danger', onclick: () => answer(true) }, 'Send as error')));
  tick();
}

async function answerToolCall(callId, output, isError) {
  if (S.ws && S.ws.readyState === WebSocket.OPEN) {
    S.ws.send(JSON.stringify({ type: 'client_tool_result', call_id: callId, output, is_error: isError }));
    return; // the card goes when client_tool_resolved arrives
  }
  try {
    await api('POST', convPath(S.conv.id, `/tool_results/${enc(callId)}`), { output, is_error: isError });
    removeRequest(callId);
  } catch (e) {
    failed(e);
    if (e.status === 404 || e.status === 409) removeRequest(callId);
    else for (const b of (S.cards.get(callId)?.querySelectorAll('button') || [])) b.disabled = false;
  }
}

function renderRequestCard(r, card) {
  if (r.client_tool) return renderToolCallCard(r, card);
  const [kind, spec] = Object.entries(r.request_type)[0] || ['custom', {}];
  const approval = approvalOf(r, kind, spec);
  const refocus = card.contains(document.activeElement);
  const heading = approval ? `Approve ${approval.tool}?` : kind === 'custom' ? `Request: ${spec.type_name}` : 'The agent asks';
  const countdown = el('span', { class: 'countdown', 'data-expires': r.expires });
  const headingId = `rqh-${r.request_id}`;
  card.setAttribute('aria-labelledby', headingId);
  const parts = [el('h3', { id: headingId, tabindex: '-1' }, countdown, heading)];
  const answer = (payload) => {
    for (const b of card.querySelectorAll('button')) b.disabled = true;
    respond(r.request_id, payload);
  };
  const labelId = spec.message && !approval ? `rq-${r.request_id}` : headingId;
  if (approval) {
    parts.push(el('pre', {}, approval.input));
  } else if (spec.message) {
    parts.push(el('div', { class: 'message', id: labelId }, spec.message));
  }
  const actions = el('div', { class: 'actions' });
  card.onsubmit = (ev) => ev.preventDefault();
  switch (kind) {
    case 'confirm':
      actions.append(
        el('button', { type: 'button', onclick: () => answer({ confirmed: true }) }, approval ? 'Allow' : 'Yes'),
        el('button', { type: 'button', onclick: () => answer({ confirmed: false }) }, approval ? 'Deny' : 'No'));
      break;
    case 'prompt': {
      const input = el('input', { type: 'text', 'aria-labelledby': labelId, placeholder: spec.placeholder || '', value: spec.default || '' });
      parts.push(input);
      card.onsubmit = (ev) => { ev.preventDefault(); answer({ text: input.value }); };
      actions.append(el('button', { type: 'submit' }, 'Answer'));
      break;
    }
    case 'select': {
      const type = spec.multi_select ? 'checkbox' : 'radio';
      const set = el('fieldset', { 'aria-labelledby': labelId },
        (spec.options || []).map((o, i) => el('label', {},
          el('input', { type, name: `opt-${r.request_id}`, value: o.value, checked: !spec.multi_select && i === 0 }),
          el('span', {}, o.label || o.value, o.description ? el('span', { class: 'muted small' }, ` — ${o.description}`) : null))));
      parts.push(set);
      card.onsubmit = (ev) => {
        ev.preventDefault();
        answer({ selected: [...set.querySelectorAll('input:checked')].map((i) => i.value) });
      };
      actions.append(el('button', { type: 'submit' }, 'Choose'));
      break;
    }
    default: {
      parts.push(el('details', {}, el('summary', {}, 'schema'), el('pre', {}, JSON.stringify(spec.schema, null, 2))));
      const input = el('textarea', { rows: 4, 'aria-label': 'Answer as JSON' }, '{}');
      parts.push(input);
      card.onsubmit = (ev) => {
        ev.preventDefault();
        let value;
        try { value = JSON.parse(input.value); } catch { toast('The answer is not valid JSON.'); return; }
        answer({ custom: value });
      };
      actions.append(el('button', { type: 'submit' }, 'Send'));
    }
  }
  actions.append(el('button', { type: 'button', class: 'danger', onclick: () => answer({ cancelled: true }) }, 'Dismiss'));
  parts.push(actions);
  card.replaceChildren(...parts);
  if (refocus) card.querySelector('h3').focus();
  tick();
}

async function respond(requestId, payload) {
  if (S.ws && S.ws.readyState === WebSocket.OPEN) {
    S.ws.send(JSON.stringify({ type: 'respond', request_id: requestId, payload }));
    return; // the card goes when client_request_resolved arrives
  }
  try {
    await api('POST', convPath(S.conv.id, `/requests/${enc(requestId)}`), { payload });
    removeRequest(requestId);
  } catch (e) {
    failed(e);
    if (e.status === 404 || e.status === 409) removeRequest(requestId);
    else for (const b of (S.cards.get(requestId)?.querySelectorAll('button') || [])) b.disabled = false;
  }
}

function tick() {
  for (const c of document.querySelectorAll('.countdown')) {
    const left = Math.max(0, Math.round((Number(c.dataset.expires) - Date.now()) / 1000));
    c.textContent = left > 0 ? `${left} s left` : 'expired';
  }
}

// ---------------------------------------------------------------------------------------
// Sub-agents and background tasks

async function loadTree() {
  if (!S.conv) return;
  const gen = S.gen;
  try {
    const root = S.conv.parent_id ? await api('GET', convPath(S.conv.parent_id)) : S.conv;
    const children = (await api('GET', convPath(root.id, '/children'))).conversations;
    if (gen !== S.gen) return;
    S.tree = [root, ...children];
  } catch (e) { if (e.status !== 404) failed(e); return; }
  renderTree();
}

function treeBadges() {
  const badges = new Map();
  for (const a of $('tree').querySelectorAll('a[data-id]')) {
    const b = a.nextElementSibling;
    if (b) badges.set(a.dataset.id, b);
  }
  return badges;
}

function renderTree() {
  const [root, ...children] = S.tree;
  const ul = $('tree');
  $('tree-empty').hidden = children.length > 0;
  if (!root || !children.length) { ul.replaceChildren(); return; }
  // The open conversation's state is the live one.
  const live = (c) => (S.conv && c.id === S.conv.id ? S.conv.state : c.state);
  const link = (c) => el('a', { href: `#/c/${enc(c.id)}`, 'aria-current': S.conv && c.id === S.conv.id ? 'page' : null, 'data-id': c.id }, title(c));
  ul.replaceChildren(el('li', {}, link(root), badge(live(root)),
    el('ul', {}, children.map((c) => el('li', { 'data-agent-id': c.id }, link(c), badge(live(c)))))));
}

function onSubAgent(f) {
  const child = S.tree.find((c) => c.id === f.agent_id);
  if (!child) { loadTree(); return; }
  child.state = f.state;
  const b = treeBadges().get(child.id);
  if (b) { b.textContent = stateLabel(f.state); setBadgeClass(b, f.state); } else renderTree();
}

let tasksTimer = null;
function loadTasksSoon() {
  clearTimeout(tasksTimer);
  tasksTimer = setTimeout(loadTasks, 200);
}

async function loadTasks() {
  if (!S.conv) return;
  const gen = S.gen;
  try {
    const list = await api('GET', convPath(S.conv.id, '/tasks'));
    if (gen !== S.gen) return;
    S.tasks = new Map(list.tasks.map((t) => [t.task_id, t]));
  } catch (e) { if (e.status !== 404) failed(e); return; }
  renderTasks();
}

function onProgress(f) {
  if (f.task_id) {
    S.progress.set(f.task_id, { progress: f.progress, message: f.message, stage: f.stage });
    if (!S.tasks.has(f.task_id)) { loadTasksSoon(); return; }
    if (f.stage === 'completed' || f.stage === 'failed' || f.stage === 'cancelled') loadTasksSoon();
    renderTasks();
    return;
  }
  // A foreground tool's progress: shown on its call.
  const call = S.toolNodes.get(f.tool_use_id)?.querySelector('.status');
  if (call && call.textContent.startsWith('running')) call.textContent = `running: ${f.message || f.stage}${f.progress != null ? ` (${Math.round(f.progress * 100)}%)` : ''}`;
}

// Each task's item is made once and updated in place, so that its Cancel button stays
// under the pointer while output streams in.
function renderTasks() {
  const tasks = [...S.tasks.values()];
  $('tasks-empty').hidden = tasks.length > 0;
  const ul = $('tasks');
  const items = new Map([...ul.children].map((li) => [li.dataset.taskId, li]));
  for (const t of tasks) {
    let li = items.get(t.task_id);
    if (!li) {
      li = el('li', { 'data-task-id': t.task_id },
        el('div', {}, el('span', { class: 'badge' }), el('span', { class: 'exit muted small' })),
        el('div', { class: 'cmd' }, t.command),
        el('progress', { max: 1, hidden: true }),
        el('div', { class: 'line muted small mono' }),
        el('button', { type: 'button', class: 'small danger', onclick: () => cancelTask(t.task_id), 'aria-label': `Cancel task ${t.command}` }, 'Cancel task'));
      ul.append(li);
    }
    const p = S.progress.get(t.task_id);
    const running = t.status === 'running';
    li.querySelector('.badge').textContent = t.status;
    li.querySelector('.exit').textContent = t.exit_code != null ? ` exit ${t.exit_code}` : '';
    const bar = li.querySelector('progress');
    bar.hidden = !(running && p && p.progress != null);
    if (!bar.hidden) bar.value = p.progress;
    li.querySelector('.line').textContent = running && p && p.message ? p.message : '';
    li.querySelector('button').hidden = !running;
  }
}

async function cancelTask(taskId) {
  const gen = S.gen;
  try {
    const r = await api('POST', convPath(S.conv.id, `/tasks/${enc(taskId)}/cancel`));
    if (gen !== S.gen) return;
    S.tasks.set(taskId, r.task);
    renderTasks();
  } catch (e) { failed(e); }
}

// ---------------------------------------------------------------------------------------
// Wiring

function wire() {
  $('signin-form').addEventListener('submit', signIn);
  $('signout').addEventListener('click', () => signOut(''));
  $('create-form').addEventListener('submit', create);
  $('new-agent').addEventListener('change', agentChosen);
  $('create').addEventListener('toggle', () => { if ($('create').open) loadAgents(); });
  $('show-archived').addEventListener('change', (e) => { S.list.archived = e.target.checked; loadList(true); });
  $('refresh').addEventListener('click', () => loadList(true));
  $('more').addEventListener('click', () => loadList(false));
  $('older').addEventListener('click', loadOlder);
  $('composer').addEventListener('submit', send);
  $('cancel').addEventListener('click', cancel);
  $('continue').addEventListener('click', continueConversation);
  $('trace-open').addEventListener('click', () => ($('trace-panel').hidden ? openTrace() : closeTrace()));
  $('trace-close').addEventListener('click', closeTrace);
  $('trace-reload').addEventListener('click', openTrace);
  $('trace-prev').addEventListener('click', () => showStep(T.at - 1));
  $('trace-next').addEventListener('click', () => showStep(T.at + 1));
  $('text').addEventListener('keydown', (e) => {
    if (e.key === 'Enter' && !e.shiftKey && !e.isComposing) { e.preventDefault(); send(); }
  });
  $('text').addEventListener('paste', (e) => {
    const files = [...(e.clipboardData?.files || [])].filter((f) => f.type.startsWith('image/'));
    if (files.length) { e.preventDefault(); addFiles(files); }
  });
  $('file').addEventListener('change', (e) => { addFiles([...e.target.files]); e.target.value = ''; });
  window.addEventListener('hashchange', route);
  setInterval(tick, 1000);
}

document.addEventListener('DOMContentLoaded', start);
