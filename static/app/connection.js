// The chat page's one TokenRelayClient (to the gateway that served the page). On a gateway
// with API keys it trades the key for a WebSocket token before every connect; the key is
// asked once per tab and kept in sessionStorage, never in a URL.

import { TokenRelayClient, wsTokenFetcher } from "../tokenrelay-client.js";

export const API_KEY = "tokenrelay.apiKey"; // sessionStorage: asked once per tab, never in a URL
const fetchToken = wsTokenFetcher(() => sessionStorage.getItem(API_KEY));

/** A WebSocket token before every connect (null when the gateway has no API keys). */
async function wsToken() {
  try {
    return await fetchToken();
  } catch (err) {
    if (err?.code !== "unauthorized") throw err;
    const key = window.prompt("This gateway needs an API key:");
    if (!key) throw err;
    sessionStorage.setItem(API_KEY, key.trim());
    return fetchToken();
  }
}

export const client = new TokenRelayClient({ token: wsToken });
