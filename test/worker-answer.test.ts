/**
 * A worker's answer line as a gateway reads it (src/cluster/protocol.ts doneEvent): a `done` line with
 * its result last keeps the result's bytes; lines of the older form (result first) and error lines are
 * read as JSON, so gateways and workers of the two versions understand each other.
 */
import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import { doneEvent } from '../src/cluster/protocol.js';

describe("a worker's answer line", () => {
  it('keeps the result of a done line written result-last as its bytes', () => {
    const result = '{"message":"Hello, \\"x\\"!","n":[1,2,{"result":3}]}';
    const event = doneEvent(
      `{"e":"done","streamed":false,"runTimeMs":4,"coldStart":true,"statusCode":200,"result":${result}}\n`,
    );
    assert.deepEqual(event, {
      e: 'done',
      streamed: false,
      runTimeMs: 4,
      coldStart: true,
      statusCode: 200,
      resultJson: result,
      result: undefined,
    });
  });

  it('reads a done line of the older form (result first) whole', () => {
    const line = '{"e":"done","result":{"a":1},"streamed":false,"runTimeMs":4,"coldStart":false,"statusCode":200}';
    assert.deepEqual(doneEvent(line), JSON.parse(line));
  });

  it('reads error lines and anything else as JSON', () => {
    const line = '{"e":"error","error":{"code":"FERRY_FUNCTION_ERROR","message":"x"},"status":500,"headers":{}}';
    assert.deepEqual(doneEvent(line), JSON.parse(line));
    assert.equal(doneEvent('not json'), undefined);
  });
});
