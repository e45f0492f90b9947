// The demo page: camera + microphone go to `runtime serve` as WebRTC tracks, and the server's events come
// back on the `events` data channel, in exactly the websocket protocol of docs/protocol.md. A server with a voice
// sends it back as an audio track, which the page plays (answers spoken while "speak answers" is on).
// Plain JS, no build step, no external URLs, so the page works offline from the server alone.
"use strict";

const $ = (id) => document.getElementById(id);
const ui = {
  token: $("token"), start: $("start"), stop: $("stop"), status: $("status"), preview: $("preview"),
  captions: $("captions"), captionsBox: $("captions-box"), unstable: $("unstable"), notes: $("notes"),
  screen: $("screen"),
  question: $("question"), ask: $("ask"), cancel: $("cancel"), answer: $("answer"),
  answerStatus: $("answer-status"), latFirst: $("lat-first"), latAsr: $("lat-asr"), latLoop: $("lat-loop"),
  conversation: $("conversation"), answerTurns: $("answer-turns"), speak: $("speak"), voice: $("voice"),
  speaking: $("speaking"),
};

const ICE_GATHER_TIMEOUT_MS = 5000; // host candidates only (no STUN), so gathering is quick; never wait forever
const MAX_CAPTION_ITEMS = 200; // keep the DOM bounded on a long session
const MAX_NOTES = 100;
const MAX_CONVERSATION_ITEMS = 100;

// Watch mode (?watch=1): follow the server's own local session (`runtime serve --camera 0`) over the read-only
// websocket /v1/watch; this browser's camera and microphone are not used, and questions are asked in the
// server's terminal.
const watching = new URLSearchParams(location.search).has("watch");
let watchSocket = null;

let pc = null; // RTCPeerConnection
let dc = null; // the `events` data channel
let stream = null; // local camera + microphone
let eventSeq = 0;

// Transcript items in arrival order: item_id -> {stable, unstable}. The server sends only the new stable
// text in each delta, plus the whole unstable tail, which replaces the previous one.
const items = new Map();

// The conversation as the server keeps it: item_id -> its <li>, in the server's order (previous_item_id).
const turns = new Map();
let turnDetection = null; // the session's turn detection (session.created/updated), null when it has none
let hasVoice = false; // the server sends a voice track: answers can be spoken
let sessionLive = false; // session.created came: session.update may be sent
let playing = false; // an answer's sound is playing (output_audio_buffer.started, not yet stopped or cleared)

// The answer being shown, and the client-side clock for "ask to first token".
let responseId = null;
let askedAt = null;
let answerItem = null; // the item the answer box shows
// One response at a time joins the conversation (the server refuses another response.create meanwhile): a
// question typed while one is asked for or answered is added at once and asked for when that answer is done.
let requested = null; // the event_id of a response.create whose response.created (or error) has not come yet
let askLater = null; // the question typed meanwhile, whose response.create waits for that answer's end

// The token: from the page URL (?token=...) so a shared link just works.
ui.token.value = new URLSearchParams(location.search).get("token") || "";

function setStatus(text, kind) {
  ui.status.textContent = text;
  ui.status.className = "status " + (kind || "");
}

function setRunning(running) {
  ui.start.disabled = running;
  ui.stop.disabled = !running;
  ui.token.disabled = running;
  ui.question.disabled = !running;
  ui.ask.disabled = !running;
  ui.cancel.disabled = !running;
}

// m:ss of media seconds, the times the server stamps on notes.
function clock(seconds) {
  const s = Math.max(0, Math.floor(seconds || 0));
  return Math.floor(s / 60) + ":" + String(s % 60).padStart(2, "0");
}

function ms(seconds) {
  return seconds < 1 ? Math.round(seconds * 1000) + " ms" : seconds.toFixed(2) + " s";
}

// ---------------------------------------------------------------- connect

async function start() {
  setRunning(true);
  resetView();
  if (watching) return watch();
  try {
    setStatus("connecting: asking for camera and microphone…", "connecting");
    stream = await navigator.mediaDevices.getUserMedia({ audio: true, video: { width: 640, height: 480 } });
    ui.preview.srcObject = stream;

    setStatus("connecting: negotiating with the server…", "connecting");
    // No STUN/TURN: the server is reached directly, and the page must work offline.
    pc = new RTCPeerConnection({ iceServers: [] });
    pc.onconnectionstatechange = onConnectionState;
    // Tracks and the data channel must exist before createOffer, so the one offer carries them all.
    for (const track of stream.getTracks()) pc.addTrack(track, stream);
    // The microphone's transceiver is sendrecv (addTrack's default), so the offer also receives the server's voice.
    pc.ontrack = onTrack;
    dc = pc.createDataChannel("events");
    dc.onopen = () => setStatus("connected: waiting for the session…", "connecting");
    dc.onmessage = (e) => onMessage(e.data);
    dc.onclose = () => { if (pc) setStatus("disconnected: the server closed the session", "error"); };

    await pc.setLocalDescription(await pc.createOffer());
    // No trickle ICE: the server answers one offer, so it must already list every candidate.
    await iceGatheringComplete(pc);

    const answer = await postOffer(pc.localDescription);
    await pc.setRemoteDescription(answer);
  } catch (err) {
    setStatus("error: " + (err && err.message ? err.message : String(err)), "error");
    teardown();
  }
}

function watch() {
  ui.question.disabled = ui.ask.disabled = ui.cancel.disabled = true; // read-only: ask in the terminal
  const token = ui.token.value.trim();
  const base = location.href.replace(/^http/, "ws").replace(/[?#].*$/, "").replace(/[^/]*$/, "");
  const socket = new WebSocket(base + "v1/watch" + (token ? "?token=" + encodeURIComponent(token) : ""));
  watchSocket = socket;
  setStatus("connecting to the server's local session…", "connecting");
  socket.onopen = () => setStatus("live: watching the server's local session (ask in its terminal)", "live");
  socket.onmessage = (e) => onMessage(e.data);
  socket.onclose = (e) => {
    if (watchSocket !== socket) return; // closed on purpose by Stop
    watchSocket = null;
    if (e.code === 1013) { // fell behind (or too many watchers): the server asks us to come back
      setStatus("reconnecting: this page fell behind the session…", "connecting");
      setTimeout(() => { if (!ui.start.disabled) return; resetView(); watch(); }, 1000);
    } else {
      setStatus("error: the watch connection closed" + (e.code === 1006 ? " (no local session, or refused: "
        + "start the server with --camera, --mic or --source; check the token)" : " (code " + e.code + ")"), "error");
      teardown();
    }
  };
}

function iceGatheringComplete(peer) {
  if (peer.iceGatheringState === "complete") return Promise.resolve();
  return new Promise((resolve) => {
    const timer = setTimeout(done, ICE_GATHER_TIMEOUT_MS);
    function done() {
      clearTimeout(timer);
      peer.removeEventListener("icegatheringstatechange", check);
      resolve();
    }
    function check() { if (peer.iceGatheringState === "complete") done(); }
    peer.addEventListener("icegatheringstatechange", check);
  });
}

async function postOffer(offer) {
  const token = ui.token.value.trim();
  const url = "v1/webrtc/offer" + (token ? "?token=" + encodeURIComponent(token) : "");
  let res;
  try {
    res = await fetch(url, {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ sdp: offer.sdp, type: offer.type }),
    });
  } catch (err) {
    throw new Error("cannot reach the server (" + err.message + ")");
  }
  let body = null;
  try { body = await res.json(); } catch (_) { /* not JSON: fall back to the HTTP status below */ }
  if (!res.ok) {
    const e = body && body.error;
    const what = e && e.message ? e.message + (e.code ? " [" + e.code + "]" : "") : res.statusText;
    throw new Error("the server refused the connection: HTTP " + res.status + " " + what);
  }
  if (!body || body.type !== "answer" || !body.sdp) throw new Error("the server sent no SDP answer");
  return body;
}

// The server's voice: played by the <audio> element; "speak answers" turns spoken answers on once the session is up.
function onTrack(e) {
  if (e.track.kind !== "audio") return;
  ui.voice.srcObject = e.streams && e.streams[0] ? e.streams[0] : new MediaStream([e.track]);
  ui.voice.play().catch(() => { /* autoplay refused: the next click (Ask) starts it */ });
  hasVoice = true;
  ui.speak.disabled = false;
  if (sessionLive) setSpeak();
}

// Cut off (Cancel, barge-in), the voice is silenced here at once: what the receiver's jitter buffer still holds of the
// cut answer (more than 200 ms on a busy machine or network) is never played. The next answer's start turns it on.
function hearVoice(on) {
  const stream = ui.voice.srcObject;
  if (stream) for (const track of stream.getAudioTracks()) track.enabled = on;
}

function setSpeak() {
  if (!hasVoice) return;
  send({ type: "session.update", session: { output_modalities: [ui.speak.checked ? "audio" : "text"] } });
}

function onConnectionState() {
  if (!pc) return;
  const state = pc.connectionState;
  if (state === "failed") {
    setStatus("error: the media connection failed (ICE); is the server reachable from this browser?", "error");
    teardown();
  } else if (state === "disconnected") {
    setStatus("connection interrupted: trying to recover…", "connecting");
  }
}

function stop() {
  teardown();
  setStatus("stopped", "");
}

function teardown() {
  if (watchSocket) { const socket = watchSocket; watchSocket = null; socket.close(); }
  const peer = pc;
  pc = null; // first, so the close handlers below know this was on purpose
  if (dc) { dc.onclose = null; dc.close(); dc = null; }
  if (peer) peer.close();
  if (stream) { for (const track of stream.getTracks()) track.stop(); stream = null; }
  ui.preview.srcObject = null;
  ui.voice.srcObject = null;
  hasVoice = sessionLive = playing = false;
  ui.speak.disabled = true;
  ui.speaking.textContent = "";
  responseId = null;
  askedAt = null;
  requested = null;
  askLater = null;
  setRunning(false);
}

function resetView() {
  items.clear();
  turns.clear();
  ui.conversation.textContent = "";
  renderCaptions();
  ui.notes.textContent = "";
  ui.answer.textContent = "";
  ui.answerStatus.textContent = "";
  delete ui.answer.dataset.question;
  ui.latFirst.textContent = ui.latAsr.textContent = ui.latLoop.textContent = "–";
}

// ---------------------------------------------------------------- client events

function send(event) {
  if (!dc || dc.readyState !== "open") {
    setStatus("error: not connected", "error");
    return false;
  }
  dc.send(JSON.stringify({ event_id: "c" + ++eventSeq, ...event }));
  return true;
}

function ask() {
  const text = ui.question.value.trim();
  if (!text) return;
  const item = { type: "message", role: "user", content: [{ type: "input_text", text: text }] };
  if (!send({ type: "conversation.item.create", item: item })) return;
  ui.question.value = "";
  if (responseId || requested) { // the answer in progress stays on screen; this one is asked for after it
    askLater = text;
    return;
  }
  requestAnswer(text);
}

// response.create for the user's pending messages; `text`, the latest, labels the answer box.
function requestAnswer(text) {
  if (!send({ type: "response.create" })) return;
  requested = "c" + eventSeq;
  askedAt = performance.now();
  ui.answer.textContent = "";
  ui.answer.dataset.question = text;
  ui.answerStatus.textContent = about("asked");
  ui.latFirst.textContent = "…";
}

// Cancel stops the answer being written and, when it is spoken, the sound at once (the API's order: cancel, clear).
// An answer written whole may still be playing: then there is nothing to cancel, only the sound to stop.
function cancel() {
  if (responseId || !playing) {
    send(responseId ? { type: "response.cancel", response_id: responseId } : { type: "response.cancel" });
  }
  if (playing) {
    hearVoice(false);
    send({ type: "output_audio_buffer.clear" });
  }
}

// ---------------------------------------------------------------- server events

function onMessage(data) {
  let event;
  try { event = JSON.parse(data); } catch (_) { return; } // the protocol is JSON only; ignore anything else
  const handler = handlers[event.type];
  if (handler) handler(event);
}

const handlers = {
  "session.created": (e) => {
    sessionLive = true;
    if (!watching && hasVoice && ui.speak.checked) setSpeak();
    setStatus((watching ? "live: watching the server's local session " : "live: session ")
      + (e.session && e.session.id || ""), "live");
    showTurnDetection(e.session);
  },

  "session.updated": (e) => showTurnDetection(e.session),

  "conversation.item.added": (e) => addTurn(e.item, e.previous_item_id),
  "conversation.item.done": (e) => { addTurn(e.item, e.previous_item_id); setTurnText(e.item); },
  "conversation.item.deleted": (e) => { const li = turns.get(e.item_id); if (li) li.remove(); turns.delete(e.item_id); },

  "conversation.item.input_audio_transcription.delta": (e) => {
    const item = itemFor(e.item_id);
    item.stable += e.delta || "";
    item.unstable = e.unstable || "";
    renderCaptions();
    const li = turns.get(e.item_id);
    if (li) li.querySelector(".text").textContent = item.stable.trim();
  },

  "conversation.item.input_audio_transcription.completed": (e) => {
    const item = itemFor(e.item_id);
    item.stable = e.transcript || "";
    item.unstable = "";
    renderCaptions();
  },

  "runtime.video.note": (e) => {
    const li = document.createElement("li");
    const time = document.createElement("time");
    time.textContent = clock(e.start) + "–" + clock(e.end);
    li.append(time, " ", e.text || "");
    ui.notes.append(li);
    while (ui.notes.children.length > MAX_NOTES) ui.notes.firstElementChild.remove();
    li.scrollIntoView({ block: "nearest" });
  },

  // Text read off the video: one entry per screen, updated in place when a line is added or read better.
  "runtime.screen.text": (e) => {
    let li = ui.screen.querySelector(`[data-screen="${CSS.escape(e.screen_id)}"]`);
    if (!li) {
      li = document.createElement("li");
      li.dataset.screen = e.screen_id;
      ui.screen.append(li);
      while (ui.screen.children.length > MAX_NOTES) ui.screen.firstElementChild.remove();
    }
    const time = document.createElement("time");
    time.textContent = clock(e.start);
    li.replaceChildren(time, " ", e.text || "");
    li.scrollIntoView({ block: "nearest" });
  },

  "response.created": (e) => {
    requested = null;
    responseId = e.response && e.response.id;
    ui.answer.textContent = "";
    ui.answerStatus.textContent = about("answering");
  },

  "response.output_text.delta": (e) => showDelta(e),
  "response.output_audio_transcript.delta": (e) => showDelta(e), // a spoken answer's words, ahead of its sound

  "response.output_text.done": (e) => {
    if (e.response_id === responseId && typeof e.text === "string") ui.answer.textContent = e.text;
  },

  "response.output_audio_transcript.done": (e) => {
    if (e.response_id === responseId && typeof e.transcript === "string") ui.answer.textContent = e.transcript;
  },

  // The voice track (WebRTC): when an answer's sound starts and ends, and when barge-in or Cancel cut it off.
  "output_audio_buffer.started": () => { playing = true; hearVoice(true); ui.speaking.textContent = "speaking"; },
  "output_audio_buffer.stopped": () => { playing = false; ui.speaking.textContent = ""; },
  "output_audio_buffer.cleared": () => { playing = false; hearVoice(false); ui.speaking.textContent = "interrupted"; },

  // Cut to what was heard (barge-in or Cancel): the answer box keeps only the words played.
  "conversation.item.truncated": (e) => { send({ type: "conversation.item.retrieve", item_id: e.item_id }); },
  "conversation.item.retrieved": (e) => {
    const part = (e.item && e.item.content || [])[0] || {};
    const li = e.item && turns.get(e.item.id);
    if (li && typeof part.transcript === "string") li.querySelector(".text").textContent = part.transcript + " …";
    if (e.item && e.item.id === answerItem && typeof part.transcript === "string") {
      ui.answer.textContent = part.transcript + " …";
    }
  },

  "response.done": (e) => {
    const r = e.response || {};
    if (r.id !== responseId) return;
    ui.answerStatus.textContent = about(r.status || "done");
    responseId = null;
    if (askLater !== null) {
      const text = askLater;
      askLater = null;
      requestAnswer(text);
    }
  },

  "runtime.metrics": (e) => {
    const m = e.metrics || {};
    if (m.asr && typeof m.asr.lag_s === "number") ui.latAsr.textContent = ms(m.asr.lag_s);
    if (m.loop_lag && typeof m.loop_lag.max_ms === "number") ui.latLoop.textContent = m.loop_lag.max_ms + " ms";
  },

  // Recoverable errors keep the session; show them plainly, the session goes on.
  error: (e) => {
    const err = e.error || {};
    if (requested !== null && err.event_id === requested) { // the request was refused: no response follows
      requested = null;
      if (err.code === "conversation_already_has_active_response") { // one this page did not know of: ask after it
        askLater = ui.answer.dataset.question || "";
        return;
      }
    }
    setStatus("error: " + (err.message || "unknown error") + (err.code ? " [" + err.code + "]" : ""), "error");
  },
};

function showDelta(e) {
  if (e.response_id !== responseId) return; // a stale answer (already replaced by a newer one)
  if (askedAt !== null) {
    ui.latFirst.textContent = ms((performance.now() - askedAt) / 1000);
    askedAt = null;
  }
  answerItem = e.item_id;
  ui.answer.textContent += e.delta || "";
  const li = turns.get(e.item_id);
  if (li) li.querySelector(".text").textContent += e.delta || "";
}

// "completed: what moved?": the answer's state, and which question it answers.
function about(state) {
  const question = ui.answer.dataset.question;
  return question ? state + ": " + question : state;
}

// ---------------------------------------------------------------- the conversation view

const ROLE_LABEL = { user: "You", assistant: "Answer", system: "System" };

function addTurn(item, previousId) {
  if (!item || !item.id || turns.has(item.id)) return;
  const li = document.createElement("li");
  const part = (item.content || [])[0] || {};
  li.className = "turn " + (item.role || "user");
  const who = document.createElement("b");
  who.textContent = (ROLE_LABEL[item.role] || item.role) + (part.type === "input_audio" ? " (spoken)" : "") + ": ";
  const text = document.createElement("span");
  text.className = "text";
  li.append(who, text);
  const after = previousId ? turns.get(previousId) : null;
  if (after) after.after(li); // where the server put it
  else if (previousId === null) ui.conversation.prepend(li); // first in the conversation
  else ui.conversation.append(li);
  turns.set(item.id, li);
  setTurnText(item);
  while (turns.size > MAX_CONVERSATION_ITEMS) {
    const oldest = turns.keys().next().value;
    turns.get(oldest).remove();
    turns.delete(oldest);
  }
  li.scrollIntoView({ block: "nearest" });
}

function setTurnText(item) {
  const li = item && turns.get(item.id);
  const part = (item && item.content || [])[0] || {};
  const text = part.transcript != null ? part.transcript : part.text;
  if (li && text) li.querySelector(".text").textContent = text;
}

// The checkbox asks the server to answer each turn: the session's turn detection with create_response (and
// interrupt_response, so speaking again cuts the answer short), or back to captions only.
function showTurnDetection(session) {
  const input = session && session.audio && session.audio.input;
  turnDetection = input ? input.turn_detection : null;
  ui.answerTurns.disabled = watching || !turnDetection;
  ui.answerTurns.checked = !!(turnDetection && turnDetection.create_response);
}

function setAnswerTurns() {
  if (!turnDetection) return;
  const on = ui.answerTurns.checked;
  send({ type: "session.update", session: { audio: { input: { turn_detection: {
    type: turnDetection.type, create_response: on, interrupt_response: on } } } } });
}

function itemFor(id) {
  let item = items.get(id);
  if (!item) {
    item = { stable: "", unstable: "" };
    items.set(id, item);
    if (items.size > MAX_CAPTION_ITEMS) items.delete(items.keys().next().value);
  }
  return item;
}

function renderCaptions() {
  let stable = "";
  let unstable = "";
  for (const item of items.values()) {
    // An earlier item's unstable tail is moot once a later one starts; only the newest is still moving.
    if (item.stable) stable += (stable ? " " : "") + item.stable.trim();
    unstable = item.unstable;
  }
  ui.captions.textContent = stable;
  ui.unstable.textContent = unstable;
  ui.captionsBox.scrollTop = ui.captionsBox.scrollHeight; // follow the newest words
}

// ---------------------------------------------------------------- wiring

if (watching) {
  ui.start.textContent = "Watch";
  setStatus("idle: press Watch to follow the server's own camera session", "");
  ui.question.placeholder = "questions go to the server's terminal in watch mode";
}

$("connect").addEventListener("submit", (e) => { e.preventDefault(); start(); });
ui.stop.addEventListener("click", stop);
$("ask-form").addEventListener("submit", (e) => { e.preventDefault(); ask(); }); // the button and Enter
ui.cancel.addEventListener("click", cancel);
ui.answerTurns.addEventListener("change", setAnswerTurns);
ui.speak.addEventListener("change", setSpeak);
window.addEventListener("pagehide", teardown); // free the camera and the server's session at once
