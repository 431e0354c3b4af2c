// How a <tokenrelay-chat> widget gets a WebSocket token from the host site's backend
// (`token-url`, docs/client.md "Widget on a gateway with API keys"): a GET with the site's own
// cookies, answering `{"token": "..."}`. widget.js loads this module.

/**
 * An Error carrying a protocol-style `code` (the client reads `code === "unauthorized"`).
 * @param {string} code @param {string} message
 */
export function codedError(code, message) {
  const err = new Error(message);
  /** @type {any} */ (err).code = code;
  return err;
}

/**
 * GET the host site's token endpoint (same-origin cookies included) and return its
 * `{"token": "..."}` (null: the gateway has no keys). Rejects with code `token_failed`.
 * @param {string} url
 * @returns {Promise<string|null>}
 */
export async function fetchTokenFrom(url) {
  let resp;
  try {
    resp = await fetch(url, { credentials: "same-origin", cache: "no-store", headers: { Accept: "application/json" } });
  } catch (err) {
    throw codedError("token_failed", `token-url: ${(err && err.message) || "network error"}`);
  }
  if (!resp.ok) throw codedError("token_failed", `token-url answered HTTP ${resp.status}`);
  let body = null;
  try {
    body = await resp.json();
  } catch {
    /* handled below */
  }
  if (!body || typeof body !== "object" || !(typeof body.token === "string" || body.token === null)) {
    throw codedError("token_failed", 'token-url must answer JSON {"token": "..."}');
  }
  return body.token;
}
