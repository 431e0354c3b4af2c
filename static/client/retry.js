// The retry policy of tokenrelay-protocol.js (sans I/O): which refusals are retried, and the
// jittered exponential backoff that spaces the retries (and tokenrelay-client.js's
// reconnects). Internal module: import these from tokenrelay-protocol.js.

/**
 * @typedef {import("../tokenrelay-protocol.js").ProtocolOptions} ProtocolOptions
 */

/**
 * Error codes after which a generate (or a resume) is sent again, with backoff, honouring the
 * frame's `retry_after`, up to `retryLimit` times.
 * @type {readonly ["unavailable", "overloaded", "rate_limited"]}
 */
export const RETRYABLE_CODES = Object.freeze(
  /** @type {["unavailable", "overloaded", "rate_limited"]} */ ([
    "unavailable",
    "overloaded",
    "rate_limited",
  ]),
);

/** @type {Readonly<Required<Omit<ProtocolOptions, "random"|"stats">>>} */
export const PROTOCOL_DEFAULTS = Object.freeze({
  cancelTimeout: 5000,
  retryLimit: 8,
  retryMaxDelay: 30000,
  backoffInitial: 250,
  backoffMax: 10000,
  backoffFactor: 2,
  backoffJitter: 0.5,
});

/**
 * Delay before attempt `attempt` (0 = the first retry): exponential backoff capped at
 * `backoffMax`, minus a random share of up to `backoffJitter` of it.
 * @param {number} attempt
 * @param {{backoffInitial?: number, backoffMax?: number, backoffFactor?: number,
 *   backoffJitter?: number}} [options]
 * @param {() => number} [random]
 * @returns {number} milliseconds
 */
export function backoffDelay(attempt, options = {}, random = Math.random) {
  const o = { ...PROTOCOL_DEFAULTS, ...options };
  const base = Math.min(o.backoffMax, o.backoffInitial * o.backoffFactor ** Math.max(0, attempt));
  const jitter = Math.min(1, Math.max(0, o.backoffJitter));
  return Math.round(base * (1 - jitter * random()));
}

/**
 * Delay before retry number `attempt` (1 = the first) of a refused generate or resume: the
 * server's `retry_after` (seconds, when it sent one) plus the jittered backoff, so that
 * clients refused together do not all come back in the same millisecond.
 * @param {number} attempt
 * @param {number|null|undefined} retryAfter seconds
 * @param {{backoffInitial?: number, backoffMax?: number, backoffFactor?: number,
 *   backoffJitter?: number}} [options]
 * @param {() => number} [random]
 * @returns {number} milliseconds
 */
export function retryDelay(attempt, retryAfter, options = {}, random = Math.random) {
  const server = typeof retryAfter === "number" && retryAfter > 0 ? retryAfter * 1000 : 0;
  return Math.round(server + backoffDelay(attempt, options, random));
}
