/**
 * A WebSocket echo server on plain node:http (RFC 6455, no dependencies). Every text or binary message
 * comes back unchanged; pings get pongs; a close frame gets a close frame with the same status code.
 * Messages over 1 MiB are refused with close code 1009. `GET /health` answers 200 for Ferry's checks.
 */
import crypto from 'node:crypto';
import http from 'node:http';

const port = Number(process.env.PORT ?? 8080);
/** Appended to the client's key to prove the server speaks WebSocket (RFC 6455 section 1.3). */
const GUID = '258EAFA5-E914-47DA-95CA-C5AB0DC85B11';
const MAX_MESSAGE = 1024 * 1024;
const OP = { CONTINUATION: 0x0, TEXT: 0x1, BINARY: 0x2, CLOSE: 0x8, PING: 0x9, PONG: 0xa };
/** Close codes: protocol error, invalid UTF-8 in a text message, message too big, server going away. */
const CLOSE = { PROTOCOL: 1002, INVALID_DATA: 1007, TOO_BIG: 1009, GOING_AWAY: 1001 };
const utf8 = new TextDecoder('utf-8', { fatal: true });
const open = new Set();

const server = http.createServer((req, res) => {
  const status = req.url === '/health' ? 200 : req.url === '/' ? 426 : 404;
  const text = status === 200 ? 'ok' : status === 426 ? 'connect with a WebSocket client' : 'not found';
  res.writeHead(status, { 'content-type': 'text/plain' });
  res.end(text);
});

server.on('upgrade', (req, socket, head) => {
  const key = req.headers['sec-websocket-key'];
  const refuse = (status, extra = '') =>
    socket.end(`HTTP/1.1 ${status}\r\nConnection: close\r\n${extra}Content-Length: 0\r\n\r\n`);
  if (req.method !== 'GET' || String(req.headers.upgrade).toLowerCase() !== 'websocket') {
    return refuse('400 Bad Request');
  }
  // The key is 16 random bytes in base64; the version must be 13 (RFC 6455 section 4.2.1).
  if (typeof key !== 'string' || Buffer.from(key, 'base64').length !== 16) return refuse('400 Bad Request');
  if (req.headers['sec-websocket-version'] !== '13') {
    return refuse('426 Upgrade Required', 'Sec-WebSocket-Version: 13\r\n');
  }
  const accept = crypto
    .createHash('sha1')
    .update(key + GUID)
    .digest('base64');
  socket.write(
    'HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n' +
      `Sec-WebSocket-Accept: ${accept}\r\n\r\n`,
  );
  socket.setNoDelay(true);
  echo(socket, head);
});

/** Writes one unmasked frame (servers never mask): FIN set, the opcode, the length in 7, 16 or 64 bits. */
function sendFrame(socket, opcode, payload) {
  let header;
  if (payload.length < 126) {
    header = Buffer.from([0x80 | opcode, payload.length]);
  } else if (payload.length < 65536) {
    header = Buffer.alloc(4);
    header.writeUInt16BE(payload.length, 2);
    header[1] = 126;
  } else {
    header = Buffer.alloc(10);
    header.writeBigUInt64BE(BigInt(payload.length), 2);
    header[1] = 127;
  }
  header[0] = 0x80 | opcode;
  socket.write(Buffer.concat([header, payload]));
}

/** Reads the client's frames from the socket and answers them. */
function echo(socket, head) {
  let buffer = head;
  let fragments = null; // the message being assembled from fragments: { opcode, parts, size }
  let closed = false;

  const close = (code) => {
    if (closed) return;
    closed = true;
    const payload = Buffer.alloc(code === undefined ? 0 : 2);
    if (code !== undefined) payload.writeUInt16BE(code);
    sendFrame(socket, OP.CLOSE, payload);
    socket.end();
    setTimeout(() => socket.destroy(), 5000).unref();
  };
  const entry = { close };
  open.add(entry);
  socket.on('close', () => open.delete(entry));
  socket.on('error', () => socket.destroy());
  socket.on('end', () => socket.end()); // the client closed TCP without a close frame
  socket.on('data', (chunk) => {
    buffer = buffer.length === 0 ? chunk : Buffer.concat([buffer, chunk]);
    while (!closed) {
      const frame = parseFrame();
      if (frame === null) return; // wait for more bytes
      handleFrame(frame);
    }
  });

  /** One whole frame off the front of `buffer`, or null when it has not fully arrived yet. */
  function parseFrame() {
    if (buffer.length < 2) return null;
    const fin = (buffer[0] & 0x80) !== 0;
    const rsv = buffer[0] & 0x70; // extension bits: none negotiated, so they must be 0
    const opcode = buffer[0] & 0x0f;
    const masked = (buffer[1] & 0x80) !== 0; // every client frame must be masked
    let length = buffer[1] & 0x7f; // 0-125 is the length itself; 126 and 127 say 16 or 64 bits follow
    let offset = 2;
    if (length === 126) {
      if (buffer.length < 4) return null;
      length = buffer.readUInt16BE(2);
      offset = 4;
    } else if (length === 127) {
      if (buffer.length < 10) return null;
      const big = buffer.readBigUInt64BE(2);
      length = big > BigInt(MAX_MESSAGE) ? MAX_MESSAGE + 1 : Number(big);
      offset = 10;
    }
    if (rsv !== 0 || !masked) return { error: CLOSE.PROTOCOL };
    // Refused from the header alone, before buffering a payload that is too big.
    const total = length + (opcode === OP.CONTINUATION && fragments ? fragments.size : 0);
    if (total > MAX_MESSAGE) return { error: CLOSE.TOO_BIG };
    if (buffer.length < offset + 4 + length) return null;
    // The payload is XORed with the 4-byte masking key that precedes it.
    const mask = buffer.subarray(offset, offset + 4);
    const payload = Buffer.from(buffer.subarray(offset + 4, offset + 4 + length));
    for (let i = 0; i < payload.length; i++) payload[i] ^= mask[i & 3];
    buffer = buffer.subarray(offset + 4 + length);
    return { fin, opcode, payload };
  }

  function handleFrame({ error, fin, opcode, payload }) {
    if (error) return close(error);
    if (opcode >= 0x8) {
      // Control frames: never fragmented, at most 125 bytes, and allowed between a message's fragments.
      if (!fin || payload.length > 125) return close(CLOSE.PROTOCOL);
      if (opcode === OP.PING) return sendFrame(socket, OP.PONG, payload);
      if (opcode === OP.PONG) return;
      if (opcode === OP.CLOSE) return close(payload.length >= 2 ? payload.readUInt16BE(0) : undefined);
      return close(CLOSE.PROTOCOL); // reserved control opcode
    }
    if (opcode === OP.CONTINUATION) {
      if (!fragments) return close(CLOSE.PROTOCOL); // nothing to continue
      fragments.parts.push(payload);
      fragments.size += payload.length;
    } else if (opcode === OP.TEXT || opcode === OP.BINARY) {
      if (fragments) return close(CLOSE.PROTOCOL); // a new message inside an unfinished one
      fragments = { opcode, parts: [payload], size: payload.length };
    } else {
      return close(CLOSE.PROTOCOL); // reserved data opcode
    }
    if (!fin) return; // more fragments to come
    const message = Buffer.concat(fragments.parts);
    const messageOpcode = fragments.opcode;
    fragments = null;
    if (messageOpcode === OP.TEXT) {
      try {
        utf8.decode(message);
      } catch {
        return close(CLOSE.INVALID_DATA);
      }
    }
    // The echo: one unfragmented frame with the message's own opcode.
    sendFrame(socket, messageOpcode, message);
  }
}

server.listen(port, () => console.log(`listening on port ${port}`));

// Ferry stops a replica with SIGTERM: say goodbye (1001) on every open WebSocket, then exit 0.
process.on('SIGTERM', () => {
  console.log('SIGTERM: closing');
  for (const ws of open) ws.close(CLOSE.GOING_AWAY);
  server.close(() => process.exit(0));
  server.closeIdleConnections();
  setTimeout(() => process.exit(0), 5000).unref();
});
