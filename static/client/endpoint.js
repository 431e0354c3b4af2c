// Where a TokenRelayClient connects: the WebSocket URL of an endpoint, with its `?token=`,
// and wsTokenFetcher (an API key traded for a short-lived WebSocket token before every
// connect). Internal module: import these from tokenrelay-client.js.

/**
 * `url` with `?token=` set.
 * @param {string} url @param {string} token
 */
export function withToken(url, token) {
  const u = new URL(url);
  u.searchParams.set("token", token);
  return u.toString();
}

/**
 * A `token` option for {@link TokenRelayClient}: trades an API key for a short-lived
 * WebSocket token with `POST /v1/ws-token` before every connect. Resolves to null when the
 * gateway has no keys configured; rejects with an error whose `code` is "unauthorized" when
 * the key is missing or wrong (the client then stops reconnecting).
 * @param {string|null|(() => string|null|Promise<string|null>)} apiKey the key, or a function
 *   returning it (e.g. read from sessionStorage)
 * @param {{endpoint?: string, fetch?: typeof fetch}} [options]
 * @returns {() => Promise<string|null>}
 */
export function wsTokenFetcher(apiKey, options = {}) {
  const url = new URL(resolveEndpoint(options.endpoint));
  url.protocol = url.protocol === "wss:" ? "https:" : "http:";
  url.pathname = url.pathname.replace(/\/v1\/ws\/?$/, "/v1/ws-token");
  url.search = "";
  return async () => {
    const doFetch = options.fetch ?? globalThis.fetch;
    const key = typeof apiKey === "function" ? await apiKey() : apiKey;
    /** @type {Record<string, string>} */
    const headers = key ? { Authorization: `Bearer ${key}` } : {};
    const resp = await doFetch(url.toString(), { method: "POST", headers });
    if (!resp.ok) {
      const err = new Error(`POST /v1/ws-token: HTTP ${resp.status}`);
      /** @type {any} */ (err).code = resp.status === 401 ? "unauthorized" : "unavailable";
      throw err;
    }
    const body = await resp.json();
    return body.token ?? null;
  };
}

/**
 * The WebSocket URL for an endpoint: http(s) becomes ws(s), relative URLs resolve against
 * `base` (default: the page's location), and `/v1/ws` is appended unless already there.
 * @param {string|undefined|null} endpoint
 * @param {string} [base]
 * @returns {string}
 */
export function resolveEndpoint(endpoint, base) {
  const origin = base ?? globalThis.location?.href;
  const url = origin ? new URL(endpoint || "/", origin) : new URL(String(endpoint));
  if (url.protocol === "http:") url.protocol = "ws:";
  else if (url.protocol === "https:") url.protocol = "wss:";
  if (url.protocol !== "ws:" && url.protocol !== "wss:") {
    throw new TypeError(`tokenrelay: endpoint must be http(s) or ws(s), got ${url.protocol}`);
  }
  if (!/\/v1\/ws\/?$/.test(url.pathname)) {
    url.pathname = `${url.pathname.replace(/\/+$/, "")}/v1/ws`;
  }
  url.hash = "";
  return url.toString();
}
