// The official `openai` SDK against a tokenrelay gateway: one scenario, run from Node
// (tests/js/openai_sdk.mjs, driven by tests/gateway/http/test_sdk_js.py) and from a
// Chromium page on another origin (tests/web/test_openai_sdk_browser.py). No Node or
// browser APIs beyond fetch and AbortController, so the same module runs in both.
//
// It returns plain data (JSON-serialisable) and leaves the assertions to pytest.

const MODEL = 'default';
const MESSAGES = [{ role: 'user', content: 'Name three colours.' }];

function contentOf(chunk) {
  return chunk.choices.map((c) => c.delta?.content ?? '').join('');
}

function errorName(err) {
  return err?.constructor?.name ?? String(err);
}

/** Resume a stream over plain fetch and return the finish reasons of its chunks. */
async function replay(baseURL, streamId, token) {
  const url = `${baseURL}/streams/${streamId}/events?resume_token=${encodeURIComponent(token)}`;
  const res = await fetch(url);
  const body = await res.text();
  const finishes = [];
  let done = false;
  for (const line of body.split('\n')) {
    if (!line.startsWith('data: ')) continue;
    const data = line.slice(6);
    if (data === '[DONE]') {
      done = true;
      continue;
    }
    for (const c of JSON.parse(data).choices ?? []) if (c.finish_reason) finishes.push(c.finish_reason);
  }
  return { status: res.status, finishes, done };
}

/**
 * Run the scenario. `OpenAI` is the SDK's default export, `baseURL` ends in `/v1`.
 * `browser` sets `dangerouslyAllowBrowser` (the SDK refuses to run in a page without it).
 */
export async function runChecks(OpenAI, { baseURL, apiKey = 'unused', browser = false }) {
  const options = { baseURL, apiKey, maxRetries: 0, timeout: 120_000, dangerouslyAllowBrowser: browser };
  const client = new OpenAI(options);
  const out = {};

  // 1. A non-streaming completion; the SDK reads x-request-id from the answer.
  const full = await client.chat.completions
    .create({ model: MODEL, messages: MESSAGES, max_tokens: 8, temperature: 0 })
    .withResponse();
  out.full = {
    text: full.data.choices[0].message.content,
    finish: full.data.choices[0].finish_reason,
    object: full.data.object,
    requestId: full.request_id,
    streamId: full.response.headers.get('x-stream-id'),
  };

  // 2. A streaming completion, iterated to the end.
  const stream = await client.chat.completions.create({
    model: MODEL, messages: MESSAGES, max_tokens: 8, temperature: 0, stream: true,
  });
  let text = '';
  let chunks = 0;
  const finishes = [];
  for await (const chunk of stream) {
    chunks += 1;
    text += contentOf(chunk);
    for (const c of chunk.choices) if (c.finish_reason) finishes.push(c.finish_reason);
  }
  out.stream = { text, chunks, finishes };

  // 3. Abort while waiting for the answer: the fetch is under way when the signal fires.
  const early = new AbortController();
  const abortingFetch = (url, init) => {
    const pending = fetch(url, init);
    early.abort();
    return pending;
  };
  const impatient = new OpenAI({ ...options, fetch: abortingFetch });
  try {
    await impatient.chat.completions.create(
      { model: MODEL, messages: MESSAGES, max_tokens: 8, stream: true },
      { signal: early.signal },
    );
    out.early = { error: null };
  } catch (err) {
    out.early = { error: errorName(err), isAbortError: err instanceof OpenAI.APIUserAbortError };
  }

  // 4. Abort a long stream after its first content chunks.
  const controller = new AbortController();
  const long = await client.chat.completions
    .create(
      { model: MODEL, messages: MESSAGES, max_tokens: 512, ignore_eos: true, temperature: 0, stream: true },
      { signal: controller.signal },
    )
    .withResponse();
  const streamId = long.response.headers.get('x-stream-id');
  const token = long.response.headers.get('x-resume-token');
  let content = 0;
  let finished = false;
  let error = null;
  try {
    for await (const chunk of long.data) {
      if (chunk.choices.some((c) => c.finish_reason)) finished = true;
      if (contentOf(chunk)) content += 1;
      if (content === 2) controller.abort();
    }
  } catch (err) {
    error = errorName(err);
  }
  out.abort = {
    streamId,
    hasToken: Boolean(token),
    contentChunks: content,
    finished,
    error,
    signalAborted: long.data.controller.signal.aborted,
  };

  // An abort is a disconnect: the stream keeps generating for --detach-timeout. Stop it
  // with the resume token, then read it back: it ends with finish_reason "cancelled".
  if (streamId && token) {
    const res = await fetch(`${baseURL}/streams/${streamId}/cancel`, {
      method: 'POST',
      headers: { 'X-Resume-Token': token },
    });
    out.abort.cancel = { status: res.status, ...(await res.json()) };
    out.abort.replay = await replay(baseURL, streamId, token);
  }
  return out;
}
