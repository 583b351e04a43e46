"""Produce (key 0): versions 3-9, flexible from 9. Every produce is refused.

Behaviour:
* every partition of the request is answered TOPIC_AUTHORIZATION_FAILED with a message saying
  why (``READ_ONLY``: produce to the source cluster, which the store mirrors); nothing is
  written; each refusal is counted (``kcompact_kafka_produce_refused``). The code is Kafka's
  answer to a principal without WRITE on the topic, which is the copy's case (it grants no one
  WRITE): every client treats it as fatal (none retries) and prints it as an authorization
  error, also those that never show a Produce's message (aiokafka, kafkajs, sarama,
  librdkafka), where POLICY_VIOLATION printed only "policy" (docs/kafka-endpoint.md lists what
  each client prints);
* a produce with acks=0 expects no answer: None, and the server closes the connection, as
  Kafka closes it when such a produce fails;
* advertised at all because librdkafka will not fetch from a broker without Produce >= 3.

Version notes:
* v3: transactional_id in the request (the first version with RecordBatch v2);
* v4-v7: the same fields (v5: log_start_offset in the response, answered -1);
* v8: record_errors and error_message in the response (the message is how a client learns why);
* v9: flexible.
"""

from __future__ import annotations

from ..wire import TOPIC_AUTHORIZATION_FAILED
from .base import READ_ONLY, register

KEY, NAME = 0, "Produce"
MIN_VERSION, MAX_VERSION, FLEXIBLE_FROM = 3, 9, 9


async def handle(ep, req, conn) -> dict | None:
    ep.count_refused_produce()
    if int(req.body.acks) == 0:
        return None
    return {"responses": [
        {"name": t.name, "partition_responses": [
            {"index": p.index, "error_code": TOPIC_AUTHORIZATION_FAILED, "base_offset": -1,
             "log_start_offset": -1, "record_errors": [], "error_message": READ_ONLY}
            for p in t.partition_data]} for t in req.body.topic_data]}


API = register(KEY, NAME, MIN_VERSION, MAX_VERSION, FLEXIBLE_FROM, handle)
