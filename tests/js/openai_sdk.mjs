// Run tests/js/openai_sdk_checks.mjs from Node with the pinned `openai` package
// (tests/js/node_modules, installed by `make js`) and print the results as one JSON line.
//
//   node tests/js/openai_sdk.mjs http://127.0.0.1:8000/v1
import OpenAI from 'openai';
import { runChecks } from './openai_sdk_checks.mjs';

const baseURL = process.argv[2];
if (!baseURL) {
  console.error('usage: node tests/js/openai_sdk.mjs BASE_URL');
  process.exit(2);
}
const results = await runChecks(OpenAI, { baseURL });
console.log(JSON.stringify(results));
