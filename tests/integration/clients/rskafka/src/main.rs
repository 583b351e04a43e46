//! rskafka (crates.io) for the client matrix (tests/integration/test_client_matrix.py): the
//! command line and the JSON lines of tests/integration/clients/clientlib.py, without `group`
//! (rskafka has no consumer groups).
//!
//!   rskafka-client read|offsets|produce|idle BOOTSTRAP TOPIC ...
//!
//! A read is what rskafka's own StreamConsumer does, one partition client per partition: fetch
//! at the next offset, which is the offset after the last record returned (rskafka drops control
//! batches and says nothing else about where a fetch ended); no position is printed.
use std::collections::BTreeMap;
use std::process::exit;
use std::time::{Duration, Instant};

use base64::Engine;
use rskafka::client::partition::{Compression, OffsetAt, PartitionClient, UnknownTopicHandling};
use rskafka::client::ClientBuilder;
use rskafka::record::Record;
use serde_json::{json, Value};

const READ_TIMEOUT: Duration = Duration::from_secs(30);

fn emit(v: Value) {
    println!("{}", v);
}

fn fail(msg: String) -> ! {
    emit(json!({ "error": msg }));
    exit(1)
}

fn b64(b: &Option<Vec<u8>>) -> Value {
    match b {
        None => Value::Null,
        Some(x) => Value::String(base64::engine::general_purpose::STANDARD.encode(x)),
    }
}

struct Tracker {
    topic: String,
    lasts: Vec<i64>,
    seen: Vec<i64>,
    count: u64,
    quiet: bool,
}

impl Tracker {
    fn add(&mut self, p: usize, offset: i64, r: &Record) {
        if offset <= self.seen[p] {
            fail(format!("partition {p}: offset {offset} delivered again (after offset {}; {} records delivered)",
                         self.seen[p], self.count));
        }
        self.seen[p] = offset;
        self.count += 1;
        if self.quiet {
            return;
        }
        let headers: Vec<Value> = r.headers.iter()
            .map(|(k, v)| json!([k, b64(&Some(v.clone()))])).collect();
        emit(json!({"topic": self.topic, "partition": p, "offset": offset,
                    "timestamp": r.timestamp.timestamp_millis(), "key": b64(&r.key),
                    "value": b64(&r.value), "headers": headers}));
    }

    fn done(&self) -> bool {
        self.lasts.iter().zip(&self.seen).all(|(l, s)| s >= l)
    }
}

async fn partitions(bs: &str, topic: &str, n: usize) -> Vec<PartitionClient> {
    let client = ClientBuilder::new(vec![bs.to_string()]).build().await
        .unwrap_or_else(|e| fail(format!("connect: {e}")));
    let mut out = vec![];
    for p in 0..n {
        out.push(client.partition_client(topic.to_string(), p as i32, UnknownTopicHandling::Error)
            .await.unwrap_or_else(|e| fail(format!("partition_client {p}: {e}"))));
    }
    out
}

/// One fetch of partition `p` at `next[p]`: its records to the tracker, `next[p]` past them.
async fn fetch_once(pc: &PartitionClient, p: usize, next: &mut [i64], t: &mut Tracker) {
    let (records, _hwm) = pc.fetch_records(next[p], 1..10_000_000, 500).await
        .unwrap_or_else(|e| fail(format!("fetch_records partition {p} at {}: {e}", next[p])));
    for r in &records {
        t.add(p, r.offset, &r.record);
        next[p] = r.offset + 1;
    }
}

async fn read_to_end(pcs: &[PartitionClient], t: &mut Tracker) -> Vec<i64> {
    let mut next = vec![];
    for pc in pcs {
        next.push(pc.get_offset(OffsetAt::Earliest).await
            .unwrap_or_else(|e| fail(format!("get_offset earliest: {e}"))));
    }
    let end = Instant::now() + READ_TIMEOUT;
    while !t.done() {
        if Instant::now() > end {
            fail(format!("not every record came in 30 s: at {:?}, last records {:?}", t.seen, t.lasts));
        }
        for (p, pc) in pcs.iter().enumerate() {
            if t.seen[p] < t.lasts[p] {
                fetch_once(pc, p, &mut next, t).await;
            }
        }
    }
    next
}

fn lasts_of(s: &str) -> Vec<i64> {
    s.split(',').map(|x| x.parse().unwrap_or_else(|_| fail(format!("bad LASTS {s}")))).collect()
}

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 4 {
        fail("usage: rskafka-client read|offsets|produce|idle BOOTSTRAP TOPIC ...".into());
    }
    let (cmd, bs, topic) = (args[1].as_str(), args[2].as_str(), args[3].as_str());
    match cmd {
        "read" | "idle" => {
            let lasts = lasts_of(args.get(4).map(String::as_str).unwrap_or(""));
            let n = lasts.len();
            let mut t = Tracker { topic: topic.into(), seen: vec![-1; n], lasts, count: 0,
                                  quiet: cmd == "idle" };
            let pcs = partitions(bs, topic, n).await;
            let mut next = read_to_end(&pcs, &mut t).await;
            if cmd == "read" {
                let none: BTreeMap<String, Value> = (0..n).map(|p| (p.to_string(), Value::Null)).collect();
                emit(json!({ "positions": none }));
                return;
            }
            let secs: f64 = args.get(5).and_then(|s| s.parse().ok()).unwrap_or(5.0);
            emit(json!({ "idle": "start" }));
            let before = t.count;
            let end = Instant::now() + Duration::from_secs_f64(secs);
            while Instant::now() < end {
                // every partition's next fetch, as a StreamConsumer per partition makes them
                let mut futs = vec![];
                for (p, pc) in pcs.iter().enumerate() {
                    let at = next[p];
                    futs.push(async move { (p, pc.fetch_records(at, 1..10_000_000, 500).await) });
                }
                for (p, got) in futures_join(futs).await {
                    let (records, _) = got.unwrap_or_else(|e| fail(format!(
                        "fetch_records partition {p} at {}: {e}", next[p])));
                    for r in &records {
                        t.add(p, r.offset, &r.record);
                        next[p] = r.offset + 1;
                    }
                }
            }
            emit(json!({ "idle": "end", "records": t.count - before }));
        }
        "offsets" => {
            let n: usize = args.get(4).and_then(|s| s.parse().ok()).unwrap_or(1);
            let pcs = partitions(bs, topic, n).await;
            let (mut e, mut l) = (BTreeMap::new(), BTreeMap::new());
            for (p, pc) in pcs.iter().enumerate() {
                e.insert(p.to_string(), pc.get_offset(OffsetAt::Earliest).await
                    .unwrap_or_else(|x| fail(format!("get_offset: {x}"))));
                l.insert(p.to_string(), pc.get_offset(OffsetAt::Latest).await
                    .unwrap_or_else(|x| fail(format!("get_offset: {x}"))));
            }
            emit(json!({ "earliest": e, "latest": l }));
        }
        "produce" => {
            let pcs = partitions(bs, topic, 1).await;
            let rec = Record { key: Some(b"k".to_vec()), value: Some(b"v".to_vec()),
                               headers: BTreeMap::new(), timestamp: chrono::Utc::now() };
            match pcs[0].produce(vec![rec], Compression::NoCompression).await {
                Ok(_) => emit(json!({ "produced": true })),
                Err(e) => emit(json!({ "produce_error": format!("{e}") })),
            }
        }
        _ => fail(format!("unknown command {cmd}")),
    }
}

/// The futures run at once (tokio::join! over a vector).
async fn futures_join<F: std::future::Future>(futs: Vec<F>) -> Vec<F::Output>
where F::Output: Send, F: Send {
    let mut out = vec![];
    let handles: Vec<_> = futs.into_iter().map(|f| Box::pin(f)).collect();
    for h in handles {
        out.push(h.await);
    }
    out
}
