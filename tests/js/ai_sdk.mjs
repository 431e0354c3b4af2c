// Run the Node scenarios of tests/js/ai_sdk_checks.mjs: TokenRelayChatTransport
// (static/tokenrelay-ai-sdk.js) under the pinned `ai` package of tests/js (`make js`),
// against a running gateway; prints the results as one JSON line.
//
//   node tests/js/ai_sdk.mjs '{"url": "http://127.0.0.1:8000", "question": ..., ...}'
//
// Node 20 needs --experimental-websocket (its WebSocket is global from Node 22 on).
import { AbstractChat, uiMessageChunkSchema } from "ai";
import { TokenRelayChatTransport } from "../../static/tokenrelay-ai-sdk.js";
import { runNodeChecks } from "./ai_sdk_checks.mjs";

const cfg = JSON.parse(process.argv[2] ?? "null");
if (!cfg?.url) {
  console.error("usage: node tests/js/ai_sdk.mjs CONFIG_JSON");
  process.exit(2);
}
if (typeof WebSocket !== "function") {
  console.error("no global WebSocket: run Node 22+, or Node 20 with --experimental-websocket");
  process.exit(2);
}
const results = await runNodeChecks({ TokenRelayChatTransport, AbstractChat, uiMessageChunkSchema }, cfg);
console.log(JSON.stringify(results));
process.exit(0);
