// kafkajs (npm) for the client matrix (tests/integration/test_client_matrix.py): the command
// line and the JSON lines of tests/integration/clients/clientlib.py.
//   node client.js read|group|offsets|produce|idle BOOTSTRAP TOPIC ...
// kafkajs has no assign(): a read is a consumer of a fresh group from the beginning, without
// commits; its position is the offset after the last one the runner resolved (the
// END_BATCH_PROCESS events: control and empty batches included).
'use strict'
const { Kafka, logLevel } = require('kafkajs')

const READ_TIMEOUT_MS = 30000
const SETTLE_MS = 8000

const b64 = b => (b === null || b === undefined ? null : Buffer.from(b).toString('base64'))
const emit = o => process.stdout.write(JSON.stringify(o) + '\n')
function fail (msg) {
  emit({ error: msg })
  process.exit(1)
}
const sleep = ms => new Promise(resolve => setTimeout(resolve, ms))
const errorText = e => `${e.name}: ${e.message}`

function kafkaOf (bs) {
  return new Kafka({
    clientId: 'kcompact-matrix',
    brokers: [bs],
    logLevel: logLevel.WARN,
    logCreator: () => ({ namespace, label, log }) =>
      process.stderr.write(`${label} ${namespace} ${log.message} ${log.error || ''}\n`)
  })
}

class Tracker {
  constructor (topic, lasts, quiet) {
    this.topic = topic
    this.lasts = lasts
    this.quiet = quiet
    this.seen = lasts.map(() => -1)
    this.count = 0
  }

  add (p, m) {
    const off = Number(m.offset)
    if (off <= this.seen[p]) {
      fail(`partition ${p}: offset ${off} delivered again (after offset ${this.seen[p]}; ` +
           `${this.count} records delivered)`)
    }
    this.seen[p] = off
    this.count++
    if (this.quiet) return
    const headers = Object.entries(m.headers || {}).flatMap(([k, v]) =>
      (Array.isArray(v) ? v : [v]).map(x => [k, b64(x)]))
    emit({
      topic: this.topic, partition: p, offset: off, timestamp: Number(m.timestamp),
      key: b64(m.key), value: b64(m.value), headers
    })
  }

  done () { return this.lasts.every((last, p) => this.seen[p] >= last) }
  missing () {
    return this.lasts.map((last, p) => this.seen[p] < last
      ? `partition ${p} at offset ${this.seen[p]} (last record ${last})` : null)
      .filter(x => x).join(', ')
  }
}

async function hwms (kafka, topic) {
  const admin = kafka.admin()
  await admin.connect()
  try {
    const out = {}
    for (const o of await admin.fetchTopicOffsets(topic)) out[o.partition] = Number(o.high)
    return out
  } finally {
    await admin.disconnect()
  }
}

async function until (cond, ms, what) {
  const end = Date.now() + ms
  while (!cond()) {
    if (Date.now() > end) {
      if (what) fail(what())
      return false
    }
    await sleep(50)
  }
  return true
}

// a consumer of `group` from the beginning; resolves with {consumer, positions}
async function consumer (kafka, topic, group, t, opts) {
  const c = kafka.consumer({ groupId: group, sessionTimeout: 10000, heartbeatInterval: 1000,
                             readUncommitted: false })
  const positions = {}
  c.on(c.events.END_BATCH_PROCESS, e => {
    positions[e.payload.partition] = Number(e.payload.lastOffset) + 1
  })
  c.on(c.events.CRASH, e => fail(`consumer crashed: ${errorText(e.payload.error)}`))
  await c.connect()
  await c.subscribe({ topic, fromBeginning: true })
  await c.run({
    autoCommit: opts.autoCommit,
    autoCommitThreshold: opts.autoCommitThreshold ?? null,
    eachMessage: async ({ partition, message }) => opts.onMessage(partition, message)
  })
  return { c, positions }
}

async function toEnd (t, positions, hwm) {
  await until(() => t.done(), READ_TIMEOUT_MS, () => `not every record came in 30 s: ${t.missing()}`)
  await until(() => t.lasts.every((_, p) => (positions[p] ?? -1) >= hwm[p]), SETTLE_MS)
}

async function read (bs, topic, lastsArg, quiet) {
  const kafka = kafkaOf(bs)
  const t = new Tracker(topic, lastsArg.split(',').map(Number), quiet)
  const hwm = await hwms(kafka, topic)
  const { c, positions } = await consumer(kafka, topic, `r-${process.pid}-${Date.now()}`, t, {
    autoCommit: false, onMessage: (p, m) => t.add(p, m)
  })
  await toEnd(t, positions, hwm)
  return { c, t, positions }
}

const commands = {
  async read (bs, topic, lasts) {
    const { c, t, positions } = await read(bs, topic, lasts, false)
    emit({ positions: Object.fromEntries(t.lasts.map((_, p) => [p, positions[p] ?? null])) })
    await c.disconnect()
  },

  async idle (bs, topic, lasts, seconds) {
    const { c, t } = await read(bs, topic, lasts, true)
    emit({ idle: 'start' })
    const before = t.count
    await sleep(Number(seconds) * 1000)
    emit({ idle: 'end', records: t.count - before })
    await c.disconnect()
  },

  async group (bs, topic, lastsArg, group, n) {
    const kafka = kafkaOf(bs)
    const t = new Tracker(topic, lastsArg.split(',').map(Number), false)
    const hwm = await hwms(kafka, topic)
    n = Number(n)
    // the first member: n records, their offsets committed, then it leaves
    const accepted = {}
    const first = await consumer(kafka, topic, group, t, {
      autoCommit: false,
      onMessage: (p, m) => {
        if (t.count >= n) return
        t.add(p, m)
        accepted[p] = Number(m.offset) + 1
      }
    })
    await until(() => t.count >= n, READ_TIMEOUT_MS, () => `the first member got ${t.count} of ${n} records in 30 s`)
    await first.c.commitOffsets(Object.entries(accepted).map(([p, o]) =>
      ({ topic, partition: Number(p), offset: String(o) })))
    await first.c.disconnect()
    // the second: resumes, commits every offset it resolves (autoCommitThreshold 1), to the
    // end. With kafkajs's defaults (no threshold, no interval) the offset of a batch holding
    // only markers is resolved but committed only with the next batch that has records, so
    // whether a partition's commit passes its last markers depends on the order the
    // partitions' fetches come back in (on Kafka too)
    const second = await consumer(kafka, topic, group, t, {
      autoCommit: true, autoCommitThreshold: 1, onMessage: (p, m) => t.add(p, m)
    })
    await toEnd(t, second.positions, hwm)
    const admin = kafka.admin()
    await admin.connect()
    const committed = async () => {
      const [got] = await admin.fetchOffsets({ groupId: group, topics: [topic] })
      return Object.fromEntries(got.partitions.map(x => [x.partition, Number(x.offset)]))
    }
    // until the commits reach the positions (a batch's commit follows its END_BATCH_PROCESS)
    let got = await committed()
    const end = Date.now() + SETTLE_MS
    const behind = () => t.lasts.some((_, p) => p in second.positions && got[p] !== second.positions[p])
    while (behind() && Date.now() < end) {
      await sleep(100)
      got = await committed()
    }
    await sleep(1000) // a record delivered again fails meanwhile
    await second.c.disconnect()
    await admin.disconnect()
    emit({ committed: got })
  },

  async offsets (bs, topic) {
    const admin = kafkaOf(bs).admin()
    await admin.connect()
    const os = await admin.fetchTopicOffsets(topic)
    await admin.disconnect()
    emit({
      earliest: Object.fromEntries(os.map(o => [o.partition, Number(o.low)])),
      latest: Object.fromEntries(os.map(o => [o.partition, Number(o.high)]))
    })
  },

  async produce (bs, topic) {
    const p = kafkaOf(bs).producer()
    try {
      await p.connect()
      await p.send({ topic, messages: [{ key: 'k', value: 'v' }] })
    } catch (e) {
      emit({ produce_error: errorText(e) })
      await p.disconnect().catch(() => {})
      return
    }
    await p.disconnect()
    emit({ produced: true })
  }
}

const [cmd, ...args] = process.argv.slice(2)
if (!commands[cmd]) fail(`unknown command ${cmd}`)
commands[cmd](...args).then(() => process.exit(0), e => fail(errorText(e)))
