-- capgate example target: a small insurance back office (SQLite).
--
-- The same tables, columns, constraints and seed rows as postgresql.sql and
-- mariadb.sql, so that one capability row runs unchanged on every engine.
-- Dates are ISO-8601 text ('YYYY-MM-DD') here and DATE elsewhere; money is
-- NUMERIC(12,2); flags are SMALLINT 0/1.  Foreign keys are enforced only on
-- connections that run PRAGMA foreign_keys = ON.
-- Executed statement by statement (split on ';' at line end); no procedural code.
-- The executor's landing-marker table (capgate_landed) is not defined here.

CREATE TABLE policy (
    policy_id      INTEGER       NOT NULL PRIMARY KEY,
    holder         VARCHAR(100)  NOT NULL,
    product        VARCHAR(20)   NOT NULL CHECK (product IN ('home', 'motor', 'travel')),
    status         VARCHAR(20)   NOT NULL CHECK (status IN ('quote', 'active', 'lapsed', 'cancelled', 'void')),
    start_date     TEXT          NOT NULL,
    sum_insured    NUMERIC(12,2) NOT NULL CHECK (sum_insured >= 0),
    annual_premium NUMERIC(12,2) NOT NULL CHECK (annual_premium >= 0)
);

CREATE TABLE cover (
    cover_id  INTEGER       NOT NULL PRIMARY KEY,
    policy_id INTEGER       NOT NULL,
    kind      VARCHAR(30)   NOT NULL,
    amount    NUMERIC(12,2) NOT NULL CHECK (amount > 0),
    CONSTRAINT cover_policy_kind_uq UNIQUE (policy_id, kind),
    CONSTRAINT cover_policy_fk FOREIGN KEY (policy_id) REFERENCES policy (policy_id)
);

CREATE TABLE premium (
    premium_id INTEGER       NOT NULL PRIMARY KEY,
    policy_id  INTEGER       NOT NULL,
    due_date   TEXT          NOT NULL,
    amount     NUMERIC(12,2) NOT NULL CHECK (amount >= 0),
    paid       SMALLINT      NOT NULL DEFAULT 0 CHECK (paid IN (0, 1)),
    paid_ref   VARCHAR(40),
    CONSTRAINT premium_paid_ref_uq UNIQUE (paid_ref),
    CONSTRAINT premium_policy_fk FOREIGN KEY (policy_id) REFERENCES policy (policy_id)
);

CREATE TABLE document_number (
    series  VARCHAR(10) NOT NULL PRIMARY KEY,
    next_no INTEGER     NOT NULL CHECK (next_no >= 1)
);

CREATE TABLE issued_document (
    series      VARCHAR(10) NOT NULL,
    doc_no      INTEGER     NOT NULL,
    policy_id   INTEGER     NOT NULL,
    kind        VARCHAR(20) NOT NULL CHECK (kind IN ('schedule', 'certificate', 'endorsement')),
    request_ref VARCHAR(64) NOT NULL,
    PRIMARY KEY (series, doc_no),
    CONSTRAINT issued_document_request_uq UNIQUE (request_ref),
    CONSTRAINT issued_document_series_fk FOREIGN KEY (series) REFERENCES document_number (series),
    CONSTRAINT issued_document_policy_fk FOREIGN KEY (policy_id) REFERENCES policy (policy_id)
);

CREATE TABLE policy_note (
    note_id   INTEGER      NOT NULL PRIMARY KEY,
    policy_id INTEGER      NOT NULL,
    author    VARCHAR(40)  NOT NULL,
    body      VARCHAR(500) NOT NULL,
    CONSTRAINT policy_note_policy_fk FOREIGN KEY (policy_id) REFERENCES policy (policy_id)
);

CREATE TABLE claim (
    claim_id    INTEGER       NOT NULL PRIMARY KEY,
    policy_id   INTEGER       NOT NULL,
    claim_ref   VARCHAR(40)   NOT NULL,
    reported_on TEXT          NOT NULL,
    amount      NUMERIC(12,2) NOT NULL CHECK (amount > 0),
    status      VARCHAR(20)   NOT NULL CHECK (status IN ('open', 'settled', 'rejected')),
    CONSTRAINT claim_ref_uq UNIQUE (claim_ref),
    CONSTRAINT claim_policy_fk FOREIGN KEY (policy_id) REFERENCES policy (policy_id)
);

CREATE INDEX premium_policy_ix ON premium (policy_id, due_date);
CREATE INDEX issued_document_policy_ix ON issued_document (policy_id);
CREATE INDEX policy_note_policy_ix ON policy_note (policy_id);
CREATE INDEX claim_policy_ix ON claim (policy_id);
CREATE INDEX policy_holder_ix ON policy (holder);

-- The stored-code object of the view DDL row (code.policy_overview).
CREATE VIEW policy_overview AS
SELECT p.policy_id, p.holder, p.status, p.sum_insured,
       (SELECT COUNT(*) FROM cover c WHERE c.policy_id = p.policy_id) AS covers,
       (SELECT COUNT(*) FROM premium r WHERE r.policy_id = p.policy_id AND r.paid = 0) AS unpaid_instalments
FROM policy p;

-- Seed data.  Invariant: each policy's sum_insured is the sum of its covers.
-- Policy 9 is the orphan: a void record left by a failed import, with 2 notes,
-- 3 instalments, 2 covers and 1 issued document (policy.purge_orphan removes them).
INSERT INTO policy (policy_id, holder, product, status, start_date, sum_insured, annual_premium) VALUES
    (1, 'Ada Lovelace',    'home',   'active',    '2024-01-01', 250000.00, 1200.00),
    (2, 'Alan Turing',     'motor',  'active',    '2024-03-01',  30000.00,  640.00),
    (3, 'Grace Hopper',    'home',   'lapsed',    '2023-06-01', 180000.00,  950.00),
    (4, 'Edsger Dijkstra', 'travel', 'cancelled', '2023-05-01',   5000.00,   90.00),
    (5, 'Ada Lovelace',    'motor',  'active',    '2024-02-01',  20000.00,  480.00),
    (9, 'Import batch 0042', 'home', 'void',      '2024-05-01', 100000.00,  700.00);

INSERT INTO cover (cover_id, policy_id, kind, amount) VALUES
    (1, 1, 'building',    200000.00),
    (2, 1, 'contents',     50000.00),
    (3, 2, 'third_party',  25000.00),
    (4, 2, 'theft',         5000.00),
    (5, 3, 'building',    150000.00),
    (6, 3, 'contents',     30000.00),
    (7, 4, 'medical',       5000.00),
    (8, 5, 'third_party',  20000.00),
    (9, 9, 'building',     80000.00),
    (10, 9, 'contents',    20000.00);

INSERT INTO premium (premium_id, policy_id, due_date, amount, paid, paid_ref) VALUES
    (1, 1, '2024-01-01', 300.00, 1, 'PAY-1001'),
    (2, 1, '2024-04-01', 300.00, 1, 'PAY-1002'),
    (3, 1, '2024-07-01', 300.00, 0, NULL),
    (4, 1, '2024-10-01', 300.00, 0, NULL),
    (5, 2, '2024-03-01', 320.00, 1, 'PAY-1003'),
    (6, 2, '2024-09-01', 320.00, 0, NULL),
    (7, 3, '2023-06-01', 950.00, 0, NULL),
    (8, 4, '2023-05-01',  90.00, 1, 'PAY-0904'),
    (9, 5, '2024-02-01', 480.00, 0, NULL),
    (10, 9, '2024-05-01', 250.00, 0, NULL),
    (11, 9, '2024-08-01', 250.00, 0, NULL),
    (12, 9, '2024-11-01', 200.00, 0, NULL);

INSERT INTO document_number (series, next_no) VALUES
    ('POL', 1005),
    ('END', 17);

INSERT INTO issued_document (series, doc_no, policy_id, kind, request_ref) VALUES
    ('POL', 1001, 1, 'schedule',    'seed-pol-1001'),
    ('POL', 1002, 2, 'schedule',    'seed-pol-1002'),
    ('POL', 1003, 3, 'schedule',    'seed-pol-1003'),
    ('POL', 1004, 9, 'schedule',    'seed-pol-1004'),
    ('END', 16,   1, 'endorsement', 'seed-end-16');

INSERT INTO policy_note (note_id, policy_id, author, body) VALUES
    (1, 1, 'jdoe',   'Customer asked for a quarterly schedule.'),
    (2, 3, 'jdoe',   'Lapse letter sent.'),
    (3, 9, 'import', 'Created by import batch 0042.'),
    (4, 9, 'import', 'Import batch 0042 failed: no holder record.');

INSERT INTO claim (claim_id, policy_id, claim_ref, reported_on, amount, status) VALUES
    (1, 2, 'CLM-2024-001', '2024-05-10', 1200.00, 'open');
