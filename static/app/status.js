// The chat page's header and debug panel: the connection indicator (with "Loading model..."
// while no engine worker is ready, and "Resumed" after a resume), the model's name from
// `GET /v1/models` and the worker's readiness, and the `?debug=1` panel's figures.

import { API_KEY, client } from "./connection.js";
import { $, sendBtn } from "./dom.js";
import { state } from "./state.js";

const STATE_LABELS = {
  idle: "Not connected",
  connecting: "Connecting...",
  open: "Connected",
  reconnecting: "Reconnecting...",
  offline: "Offline: waiting for the network...",
  closed: "Disconnected",
};

// --- connection indicator ----------------------------------------------------------------

const connEl = $("connection");
const connLabel = $("connection-label");
let resumedTimer = 0;

/** @param {string} connState the client's connection state */
export function showState(connState) {
  // connected, but no engine worker ready yet: say so, and hold the send button
  const loading = connState === "open" && !client.workerReady;
  connEl.dataset.state = loading ? "loading" : connState;
  sendBtn.disabled = loading;
  if (connState !== "open") {
    delete connEl.dataset.resumed;
    clearTimeout(resumedTimer);
  }
  if (connState === "open" && connEl.dataset.resumed === "true") return;
  connLabel.textContent = loading ? "Loading model..." : (STATE_LABELS[connState] ?? connState);
}

/** A stream was resumed: the indicator says so for a few seconds. */
export function flashResumed() {
  connEl.dataset.resumed = "true";
  connLabel.textContent = "Resumed";
  clearTimeout(resumedTimer);
  resumedTimer = setTimeout(() => {
    delete connEl.dataset.resumed;
    connLabel.textContent = STATE_LABELS[client.state] ?? client.state;
  }, 4000);
}

// --- model and worker readiness -----------------------------------------------------------

const modelEl = $("model");
const modelName = $("model-name");
const workerState = $("worker-state");
let modelLoaded = false;

/** The served model's name from `GET /v1/models` (with the API key, on a gateway that has keys). */
async function loadModelName() {
  if (modelLoaded) return;
  const key = sessionStorage.getItem(API_KEY);
  try {
    const r = await fetch(new URL("/v1/models", location.origin), {
      headers: key ? { Authorization: `Bearer ${key}` } : {},
      credentials: "omit",
    });
    if (!r.ok) return; // tried again on the next connect
    const body = await r.json();
    const id = body?.data?.[0]?.id;
    if (typeof id !== "string" || !id) return;
    modelLoaded = true;
    modelName.textContent = id;
    showReadiness();
  } catch {
    /* offline or refused: tried again on the next connect */
  }
}

/** The header's worker readiness: ready, loading (connected, no worker yet) or unknown. */
export function showReadiness() {
  const open = client.state === "open";
  const ready = open ? (client.workerReady ? "true" : "false") : "unknown";
  modelEl.dataset.ready = ready;
  workerState.textContent =
    ready === "true" ? "ready" : ready === "false" ? "loading" : "not connected";
  modelEl.title = `Model: ${modelLoaded ? modelName.textContent : "unknown"}, worker: ${workerState.textContent}`;
}

// --- debug panel -------------------------------------------------------------------------

const debugEl = $("debug");
function setDebug(testid, value) {
  const el = debugEl?.querySelector(`[data-testid=${testid}]`);
  if (el) el.textContent = String(value);
}

/** Refresh the `?debug=1` panel (nothing without it). */
export function updateDebug() {
  if (!debugEl) return;
  const active = state.active;
  setDebug("debug-socket", client.state);
  setDebug("debug-stream-id", active?.stream.streamId ?? active?.record.streamId ?? "-");
  setDebug("debug-last-seq", active?.stream.lastSeq ?? 0);
  setDebug("debug-resumes", client.stats.resumes);
  setDebug("debug-reconnects", client.stats.reconnects);
  setDebug("debug-duplicates", client.stats.duplicates);
  setDebug("debug-endpoint", client.url);
}

/** Follow the client: its state, the worker's readiness, and the model once connected. */
export function bindStatus() {
  client.addEventListener("state", (e) => {
    showState(e.detail.state);
    showReadiness();
    updateDebug();
  });
  client.addEventListener("readiness", () => {
    showState(client.state);
    showReadiness();
  });
  client.addEventListener("open", () => {
    showReadiness();
    loadModelName();
  });
}
